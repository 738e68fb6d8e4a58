"""Expert parallelism (parallelism.ep) trains a tiny Qwen3-MoE as one process does: EP 2 on 2 ranks, FSDP 2 x
EP 2 and HSDP 2 x EP 2 on 4 ranks, with full and per-op activation checkpointing, and with compile.

The reference runs each rank's share of every global batch in turn on one process (tests/distributed/
_moe_steps.py). In float32 a layout changes only the order of sums (an expert's weight gradient sums the
rows of every EP rank in one GEMM instead of one share after the other; FSDP reduce-scatters the other
gradients), and the routing, the balance loss and the expert-bias update are computed from the same
numbers. Measured on a 2-core AMD EPYC (Zen 5) CPU over 20 AdamW steps: the losses of every float32 layout
below equal the reference exactly (difference 0); FP32_RTOL = 1e-6 leaves room for summation order on
other CPUs, while a real error is far larger: dropping the tokens routed to the other rank's experts (the
negative control) moves the losses by 1.7e-4 relative within 3 steps (the freshly initialised experts add
little to the residual stream yet), 165 times the tolerance.
"""
from __future__ import annotations

import functools

import pytest
import torch
from _harness import run_ranks
from _moe_steps import Run, run_single, train_runs

FP32_RTOL = 1e-6
STEPS = 20


def _rel_diff(values, reference) -> float:
    return max(abs(a - b) / abs(b) for a, b in zip(values, reference, strict=True))


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
    assert _rel_diff(got["losses"], ref["losses"]) <= FP32_RTOL, (got["losses"], ref["losses"])
    assert _rel_diff(got["grad_norms"], ref["grad_norms"]) <= FP32_RTOL
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
    assert _rel_diff(got["losses"], ref["losses"][:3]) > 50 * FP32_RTOL
