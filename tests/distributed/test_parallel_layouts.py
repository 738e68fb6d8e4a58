"""FSDP 2, HSDP 2x2, FSDP x TP 2x2 and TP 2 reproduce the single-process training of the same global batch.

Each layout is launched once (gloo on CPU) and trains every numerics variant in turn: fp32, bf16, and
float8 tensorwise with float8 all-gather and scale precompute (plus row-wise float8 on FSDP x TP).
"""
from __future__ import annotations

import pytest
import torch
from _llama_steps import LAYOUTS, layout_results, layout_runs, single_process_results

# fp32: a layout only changes the order of float32 sums (reduce-scatter of per-rank partial gradients,
# TP partial products); measured differences stay below 3e-7 relative over 10 AdamW steps, so 1e-5
# leaves margin while any real error (a gradient scaled by the dp degree, a shard counted twice) is
# orders of magnitude larger.
FP32_RTOL = 1e-5
# bf16: FSDP casts parameters and block inputs to bf16, while the single-process reference runs under
# autocast (residual stream kept in fp32); per-element bf16 rounding (2^-8) mostly averages out in a loss
# over ~400 tokens: measured below 4e-4, tolerance 5e-3 (the acceptance bound is 2e-2).
BF16_RTOL = 5e-3
# float8: identical scales (the global amax) and casts, but an fp32 rounding difference in a weight can
# move it across a float8 rounding boundary (2^-3 relative steps for e4m3), and the optimizer carries
# that on; measured below 1.5e-4 relative over 10 steps, tolerance 1e-3.
FP8_RTOL = 1e-3


def _rel_diff(values, reference) -> float:
    return max(abs(a - b) / abs(b) for a, b in zip(values, reference, strict=True))


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_fp32_losses_grad_norms_and_first_gradients_match_single_process(layout):
    run = layout_runs(layout)["fp32"]
    got, ref = layout_results(layout)["fp32"], single_process_results(run.single_process())
    assert len(got["losses"]) == 10
    assert _rel_diff(got["losses"], ref["losses"]) < FP32_RTOL, (got["losses"], ref["losses"])
    assert _rel_diff(got["grad_norms"], ref["grad_norms"]) < FP32_RTOL
    # Gradients are SUMMED over data-parallel ranks: averaging would scale them by 1/dp, which Adam's
    # scale invariance would hide from the losses but not from this comparison.
    assert set(got["first_grads"]) == set(ref["first_grads"])
    for name, g in got["first_grads"].items():
        torch.testing.assert_close(g, ref["first_grads"][name], rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_bf16_losses_match_single_process(layout):
    run = layout_runs(layout)["bf16"]
    got, ref = layout_results(layout)["bf16"], single_process_results(run.single_process())
    assert _rel_diff(got["losses"], ref["losses"]) < BF16_RTOL, (got["losses"], ref["losses"])


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_float8_tensorwise_allgather_precompute_matches_single_process(layout):
    run = layout_runs(layout)["fp8"]
    got, ref = layout_results(layout)["fp8"], single_process_results(run.single_process())
    assert _rel_diff(got["losses"], ref["losses"]) < FP8_RTOL, (got["losses"], ref["losses"])
    # float8 changes the numerics visibly: the comparison above is not fp32 against itself.
    fp32 = single_process_results(layout_runs(layout)["fp32"].single_process())
    assert _rel_diff(ref["losses"], fp32["losses"]) > 1e-6


@pytest.mark.parametrize("layout, variant, rtol", [
    ("fsdp2_tp2", "rowwise", FP8_RTOL),
    ("fsdp2_tp2", "fp8_wk_wv_hp", FP8_RTOL),
    ("tp2", "fp8_wk_wv_hp", FP8_RTOL),
    ("fsdp2", "bf16_fp8", BF16_RTOL),
    ("fsdp2", "reshard_always", FP32_RTOL),
    ("fsdp2", "reshard_never", FP32_RTOL),
    ("tp2", "no_sp_no_loss_parallel", FP32_RTOL),
])
def test_other_variants_match_single_process(layout, variant, rtol):
    run = layout_runs(layout)[variant]
    got, ref = layout_results(layout)[variant], single_process_results(run.single_process())
    assert all(torch.isfinite(torch.tensor(got["losses"])))
    assert _rel_diff(got["losses"], ref["losses"]) < rtol, (got["losses"], ref["losses"])


@pytest.mark.parametrize("variant, block_all_gathers", [
    ("reshard_always", 4),  # both blocks gathered again in backward
    ("fp32", 3),  # default: the last block stays unsharded for backward
    ("reshard_never", 2),  # nothing is gathered again
])
def test_reshard_after_forward_policy_sets_backward_all_gathers(variant, block_all_gathers):
    calls = layout_results("fsdp2")[variant]["collectives"]["fwd_bwd"]
    sizes = [c.nbytes for c in calls if c.op == "_allgather_base_"]
    block_bytes = max(sizes)  # a block's parameters outweigh the embedding's and the head's here
    assert sizes.count(block_bytes) == block_all_gathers, sizes
