"""Expert parallelism (parallelism.ep) trains a tiny Qwen3-MoE as one process does: EP 2 on 2 ranks, FSDP 2 x
EP 2 and HSDP 2 x EP 2 on 4 ranks, with full and per-op activation checkpointing, and with compile.

The reference runs each rank's share of every global batch in turn on one process (tests/distributed/
_moe_ep_steps.py). In float32 a layout changes only the order of sums (an expert's weight gradient sums the
rows of every EP rank in one GEMM instead of one share after the other; FSDP reduce-scatters the other
gradients), and the routing, the balance loss and the expert-bias update are computed from the same
numbers. Measured on a 2-core AMD EPYC (Zen 5) CPU over 20 AdamW steps, max relative difference from the
reference: losses 1.2e-7 (EP 2, with or without checkpointing) and 1.0e-7 (FSDP 2 x EP 2, HSDP 2 x EP 2,
EP 4); gradient norms 3.6e-7 and 2.4e-7. FP32_RTOL = 1e-6 (losses) and GRAD_NORM_RTOL = 2e-6 leave room
for summation order on other CPUs, while a real error is far larger: dropping the tokens routed to the other
rank's experts (the negative control) moves the losses by 1.7e-4 relative within 3 steps (the freshly
initialised experts add little to the residual stream yet), 165 times the tolerance.
"""
from __future__ import annotations

import functools

import pytest
import torch
from _harness import run_ranks
from _moe_ep_steps import Run, collectives_of_one_step, run_single, train_runs
from _rel_diff import rel_diff

FP32_RTOL = 1e-6
GRAD_NORM_RTOL = 2e-6
STEPS = 20


TWO_RANKS = {
    "ep2": Run(dp_shard=2, ep=2, steps=STEPS),
    "ep2_full_ac": Run(dp_shard=2, ep=2, ac_mode="full", steps=STEPS),
    "ep2_every_2nd_ac": Run(dp_shard=2, ep=2, ac_mode="selective", ac_option="2", steps=STEPS),
    "ep2_drops_remote_tokens": Run(dp_shard=2, ep=2, steps=3, drop_remote_tokens=True),
}
FOUR_RANKS = {
    "fsdp2_ep2": Run(dp_shard=4, ep=2, steps=STEPS),
    "hsdp2_ep2": Run(dp_replicate=2, dp_shard=2, ep=2, steps=STEPS),
    "ep4": Run(dp_shard=4, ep=4, steps=STEPS),
}


@functools.cache
def _launch(world_size: int) -> dict[str, list[dict]]:
    """Every run of that world size in one launch; name -> per-rank results."""
    runs = TWO_RANKS if world_size == 2 else FOUR_RANKS
    per_rank = run_ranks(train_runs, world_size, list(runs.values()), keep_first_grads=True)
    return {name: [rank_results[i] for rank_results in per_rank] for i, name in enumerate(runs)}


@functools.cache
def _reference(world_size: int) -> dict:
    # Every float32 layout of one world size has the same reference: world_size shares in turn.
    return run_single(Run(dp_shard=world_size, steps=STEPS), keep_first_grads=True)


@pytest.mark.parametrize("world_size, name", [(2, "ep2"), (2, "ep2_full_ac"), (2, "ep2_every_2nd_ac"),
                                              (4, "fsdp2_ep2"), (4, "hsdp2_ep2"), (4, "ep4")])
def test_expert_parallel_float32_losses_and_gradients_match_one_process(world_size, name):
    got, ref = _launch(world_size)[name][0], _reference(world_size)
    assert len(got["losses"]) == STEPS
    assert rel_diff(got["losses"], ref["losses"]) <= FP32_RTOL, (got["losses"], ref["losses"])
    assert rel_diff(got["grad_norms"], ref["grad_norms"]) <= GRAD_NORM_RTOL
    # Expert gradients are SUMMED over the ranks that sent tokens (all-to-all backward) and over efsdp /
    # dp_replicate (FSDP): a missing or doubled contribution would be off by a factor, not by rounding.
    assert set(got["first_grads"]) == set(ref["first_grads"])
    for param, g in got["first_grads"].items():
        torch.testing.assert_close(g, ref["first_grads"][param], rtol=1e-5, atol=1e-7, msg=param)


@pytest.mark.parametrize("world_size, name", [(2, "ep2"), (2, "ep2_full_ac"), (4, "fsdp2_ep2"), (4, "hsdp2_ep2")])
def test_expert_bias_is_the_same_on_every_rank_and_as_on_one_process(world_size, name):
    results, ref = _launch(world_size)[name], _reference(world_size)
    final = [r["bias"][-1] for r in results]
    assert final[0].abs().max() > 0  # the bias moved (so the comparison is not between zeros)
    for other in final[1:]:
        assert torch.equal(other, final[0])
    # The loads are summed over all data ranks before the update: each rank's own loads would give another
    # bias (the update is a sign, so equal bits are the expectation, not a tolerance).
    assert torch.equal(final[0], ref["bias"][-1])


def test_negative_control_dropping_the_tokens_sent_to_another_rank_is_detected():
    got = _launch(2)["ep2_drops_remote_tokens"][0]
    ref = _reference(2)
    assert rel_diff(got["losses"], ref["losses"][:3]) > 50 * FP32_RTOL


def _exchanges_of_one_step(rank: int, world_size: int) -> dict[str, dict[str, int]]:
    counts = {}
    for ac_mode, option in (("none", "op"), ("full", "op"), ("selective", "2")):
        calls = collectives_of_one_step(rank, world_size, Run(dp_shard=2, ep=2, ac_mode=ac_mode, ac_option=option))
        counts[ac_mode] = {phase: ops.count("all_to_all_single") for phase, ops in calls.items()}
    return counts


def test_full_checkpointing_replays_the_exchanges_instead_of_communicating_again():
    # Per MoE layer (2 here), the forward exchanges the counts, the rows and the results (3 all-to-alls) and
    # the backward sends the gradients of the two row exchanges back (2). A recomputation that routed and
    # exchanged again would add the forward's 3 per layer to the backward (10 with full checkpointing, 7
    # with every 2nd block checkpointed).
    for counts in run_ranks(_exchanges_of_one_step, 2, timeout_s=120):
        assert counts == {mode: {"forward": 6, "backward": 4} for mode in ("none", "full", "selective")}


# Compile needs bfloat16 (torch._grouped_mm is traced for bf16 only). The reference is the one-process bf16 run
# (FSDP on a one-rank mesh: the same parameter casts) compiled as EP compiles a block (the plan's ep_compile_regions: all
# but the MoE dispatch and combine), so inductor's fusions are the same. What EP still changes in bf16: an
# expert's weight gradient is one bf16 GEMM over both ranks' rows where the reference rounds each share's
# separately, a bf16-rounding difference that training compounds. Measured per step (20 steps), EP 2 compiled
# against the reference: 0 at step 1 (the forward is the same), at most 5.0e-5 over steps 1-10 and 8.7e-4
# over 1-20; the float32 run against the same reference (bf16's effect): 2.6e-5 at step 1, 4.8e-4 over 1-10.
# So the first ten steps are checked two-sided (the float32 run must fail the bound), all twenty against the
# bf16 noise level only.
BF16_FIRST_10_RTOL = 1.5e-4
BF16_20_STEPS_RTOL = 2e-3
# The first gradients (per parameter, |difference| / |reference|, 2-norms): measured 2.2e-3 at most (the experts'
# weights: the bf16 GEMM over both ranks' rows) against bf16's own effect of 3.0e-3 to 9.1e-3, so the check is
# one-sided: 9x the layout's rounding, and 25x below a gradient counted twice or missed (off by 0.5 to 1), which
# the losses hardly show (AdamW's first steps do not depend on a gradient's scale).
BF16_FIRST_GRAD_RTOL = 2e-2


def test_expert_parallel_with_compile_and_full_ac_matches_one_process_bf16():
    runs = [Run(dp_shard=2, ep=2, param_dtype="bfloat16", compile=True, steps=STEPS),
            Run(dp_shard=2, ep=2, param_dtype="bfloat16", compile=True, ac_mode="full", steps=STEPS)]
    compiled, compiled_full_ac = run_ranks(train_runs, 2, runs, timeout_s=900, keep_first_grads=True)[0]
    reference, fp32 = run_single(runs[0], keep_first_grads=True), _reference(2)
    assert compiled["losses"][0] == reference["losses"][0]
    # The first gradients, which the losses cannot vouch for (AdamW's first steps hardly depend on a gradient's scale).
    assert set(compiled["first_grads"]) == set(reference["first_grads"])
    for param, grad in compiled["first_grads"].items():
        ref = reference["first_grads"][param].float()
        rel = float((grad.float() - ref).norm() / ref.norm())
        assert rel <= BF16_FIRST_GRAD_RTOL, (param, rel)
    for param, grad in compiled_full_ac["first_grads"].items():
        torch.testing.assert_close(grad, compiled["first_grads"][param], rtol=0, atol=0, msg=param)
    assert rel_diff(compiled["losses"][:10], reference["losses"][:10]) < BF16_FIRST_10_RTOL
    assert rel_diff(fp32["losses"][:10], reference["losses"][:10]) > BF16_FIRST_10_RTOL
    assert rel_diff(compiled["losses"], reference["losses"]) < BF16_20_STEPS_RTOL
    # Full checkpointing replays the forward's routing and exchanges: the same numbers to the bit.
    assert compiled_full_ac["losses"] == compiled["losses"]
