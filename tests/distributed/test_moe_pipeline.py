"""Pipeline parallelism trains a tiny Qwen3-MoE (4 blocks, both balancing schemes) as one process does: PP 2 with
1F1B, Interleaved1F1B, ZBVZeroBubble and DualPipeV, 1F1B with full activation checkpointing, and PP 2 x FSDP 2 x EP 2 on 4
ranks (1F1B without and with checkpointing, Interleaved1F1B with it, ZBVZeroBubble without).
tests/distributed/_moe_pp_steps.py runs the stages as the trainer does.

The balance loss enters through the MoE layers' outputs (models/common/moe/aux_loss_grad.py) weighted 1 / (pipeline
micro-batches x data-parallel ranks): the routers' gradients must equal the one-process run's, where the whole
batch is one forward. In float32 only the order of sums differs. Measured on a 2-core AMD EPYC CPU over 8 AdamW
steps, max relative difference from the reference: losses 1.8e-7, gradient norms 3.0e-7; FP32_RTOL = 1e-6 and
GRAD_NORM_RTOL = 2e-6 as the expert-parallel tests; the first step's router gradients (entries up to 1.5e-4)
differ by 1.2e-10 at most, checked at rtol 1e-5 + atol 1e-8. The negative control weights the balance loss 4
times (what a forgotten 1 / micro-batches would do at 4 micro-batches): its router gradients miss that bound by
a factor of 5.7e4 (asserted > 100).
"""
from __future__ import annotations

import functools

import pytest
import torch
from _harness import run_ranks
from _moe_pp_steps import PPRun, train, train_runs
from _rel_diff import rel_diff

from models.common.moe.router_stats import merge_router_stats

FP32_RTOL = 1e-6
GRAD_NORM_RTOL = 2e-6
ROUTER_GRAD_RTOL, ROUTER_GRAD_ATOL = 1e-5, 1e-8

TWO_RANKS = {
    "1F1B": PPRun(pp=2),
    "Interleaved1F1B": PPRun(pp=2, schedule="Interleaved1F1B"),
    "ZBVZeroBubble": PPRun(pp=2, schedule="ZBVZeroBubble"),
    "DualPipeV": PPRun(pp=2, schedule="DualPipeV"),
    "1F1B_full_ac": PPRun(pp=2, ac_mode="full"),
    "1F1B_balance_loss_x4": PPRun(pp=2, aux_weight=4.0, steps=1),
}
FOUR_RANKS = {
    "1F1B_ep2": PPRun(pp=2, dp_shard=2, ep=2),
    "1F1B_ep2_full_ac": PPRun(pp=2, dp_shard=2, ep=2, ac_mode="full"),
    "Interleaved1F1B_ep2_full_ac": PPRun(pp=2, dp_shard=2, ep=2, ac_mode="full", schedule="Interleaved1F1B"),
    # Without checkpointing (with it, refused: tests/unit/test_pipeline_moe.py).
    "ZBVZeroBubble_ep2": PPRun(pp=2, dp_shard=2, ep=2, schedule="ZBVZeroBubble"),
}


@functools.cache
def _launch(world_size: int) -> dict[str, list[dict]]:
    runs = TWO_RANKS if world_size == 2 else FOUR_RANKS
    per_rank = run_ranks(train_runs, world_size, list(runs.values()), timeout_s=600)
    return {name: [rank_results[i] for rank_results in per_rank] for i, name in enumerate(runs)}


@functools.cache
def _reference() -> dict:
    return run_ranks(train, 1, PPRun())[0]


def _merged(results: list[dict], key: str) -> dict:
    merged: dict = {}
    for rank_results in results:
        merged |= rank_results[key]
    return merged


@pytest.mark.parametrize("world_size, name", [(2, "1F1B"), (2, "Interleaved1F1B"), (2, "ZBVZeroBubble"),
                                              (2, "DualPipeV"), (2, "1F1B_full_ac"), (4, "1F1B_ep2"), (4, "1F1B_ep2_full_ac"),
                                              (4, "Interleaved1F1B_ep2_full_ac"), (4, "ZBVZeroBubble_ep2")])
def test_pipeline_moe_float32_matches_one_process(world_size, name):
    results, ref = _launch(world_size)[name], _reference()
    got = results[0]
    assert all(r["losses"] == got["losses"] for r in results)  # every rank logs the last stage's loss
    assert rel_diff(got["losses"], ref["losses"]) <= FP32_RTOL, (got["losses"], ref["losses"])
    assert rel_diff(got["grad_norms"], ref["grad_norms"]) <= GRAD_NORM_RTOL
    routers = _merged(results, "router_grads")
    assert set(routers) == set(ref["router_grads"])
    for param, grad in routers.items():
        torch.testing.assert_close(grad, ref["router_grads"][param], rtol=ROUTER_GRAD_RTOL, atol=ROUTER_GRAD_ATOL,
                                   msg=param)
    # The expert bias moves by signs of summed loads: the same bits, on every layer of every stage.
    biases = _merged(results, "bias")
    assert set(biases) == set(ref["bias"]) and any(b.abs().max() > 0 for b in biases.values())
    for layer, bias in biases.items():
        assert torch.equal(bias, ref["bias"][layer]), layer
    # The router statistics (reduced over the data-parallel ranks) of all stages merge into the one-process model's.
    stats = merge_router_stats([part for r in results if r["dp_rank"] == 0 for part in r["router_stats"]])
    (ref_stats,) = ref["router_stats"]
    assert set(stats) == set(ref_stats)
    for tag, value in ref_stats.items():
        assert stats[tag] == pytest.approx(value, rel=1e-5), tag


def test_negative_control_a_balance_loss_weighted_four_times_moves_the_router_gradients():
    got, ref = _merged(_launch(2)["1F1B_balance_loss_x4"], "router_grads"), _reference()["router_grads"]
    worst = max(float(((got[p] - ref[p]).abs() / (ROUTER_GRAD_ATOL + ROUTER_GRAD_RTOL * ref[p].abs())).max())
                for p in ref)
    assert worst > 100
