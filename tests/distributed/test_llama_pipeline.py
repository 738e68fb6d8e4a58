"""A Llama 3 pipeline built and stepped as the trainer does (tests/distributed/_llama_pp_steps.py) trains as one
process: PP 2 x FSDP 2 with float8 tensorwise, the FSDP float8 all-gather and precomputed scales per stage; TP 2 x
PP 2; compiled, fully checkpointed stages. One launch per world size (4 ranks: the float8 and TP runs; 2 ranks: the
compiled run), one 1-rank launch for the references; 3 steps each. The end-to-end runs through run_train.sh
(tests/integration/test_train_pipeline.py, marked slow) cover the same features with the trainer itself.

Measured on this project's 2-core CPU test machine, max relative loss difference over the 3 steps:
  float8 PP 2 x FSDP 2 against float8 on one process with the same 1-sample micro-batches: 8.1e-6
    (the same casts; a last-bit change of a weight can move a tensor's amax and so its whole float8 rounding);
    float8 against float32 on one process: 4.2e-4, so FP8_RTOL = 1e-4 tells them apart (asserted);
  TP 2 x PP 2 against float32 on one process: 1.2e-7 (order of sums only), FP32_RTOL = 1e-6;
  compiled (aot_eager) fully checkpointed PP 2 against eager one process: bit-identical, FP32_RTOL.
"""
from __future__ import annotations

import functools

import torch
from _harness import run_ranks
from _llama_pp_steps import PPRun, train_runs
from _rel_diff import rel_diff

FP32_RTOL = 1e-6
FP8_RTOL = 1e-4

REFERENCES = {"fp32": PPRun(), "fp8": PPRun(float8=True, accumulation=4)}
"""One process: float32 on the whole batch; float8 on the 4 one-sample micro-batches of the pipeline runs."""
FOUR_RANKS = {"pp2_fsdp2_fp8": PPRun(pp=2, dp_shard=2, float8=True), "tp2_pp2": PPRun(pp=2, tp=2)}
# aot_eager traces with dynamo and AOT autograd (through the checkpoint wrapper) at a fraction of inductor's CPU
# compile time; inductor under PP stays in the slow integration test.
TWO_RANKS = {"pp2_compile_full_ac": PPRun(pp=2, compile=True, ac_mode="full")}


@functools.cache
def _references() -> dict[str, dict]:
    return {name: results[0] for name, results in _launch(1).items()}


@functools.cache
def _launch(world_size: int) -> dict[str, list[dict]]:
    runs = {1: REFERENCES, 2: TWO_RANKS, 4: FOUR_RANKS}[world_size]
    per_rank = run_ranks(train_runs, world_size, list(runs.values()), timeout_s=600)
    return {name: [rank_results[i] for rank_results in per_rank] for i, name in enumerate(runs)}


def _check_losses(results: list[dict], reference: dict, rtol: float, *, grad_norms: bool = True) -> None:
    got = results[0]
    assert all(r["losses"] == got["losses"] for r in results)  # every rank holds the last stage's loss
    assert rel_diff(got["losses"], reference["losses"]) <= rtol, (got["losses"], reference["losses"])
    if grad_norms:
        assert rel_diff(got["grad_norms"], reference["grad_norms"]) <= 10 * rtol, (got["grad_norms"],
                                                                                     reference["grad_norms"])


def test_pp2_x_fsdp2_float8_with_the_fp8_all_gather_and_precomputed_scales_trains_as_one_process():
    results, refs = _launch(4)["pp2_fsdp2_fp8"], _references()
    _check_losses(results, refs["fp8"], FP8_RTOL)
    # The tolerance tells float8 from float32: float32 on one process misses it.
    assert rel_diff(refs["fp32"]["losses"], refs["fp8"]["losses"]) > FP8_RTOL
    for rank in results:
        fwd_bwd, optimizer = rank["collectives"]["fwd_bwd"], rank["collectives"]["optimizer"]
        # Each stage's block is all-gathered once per step (never resharded under a pipeline), as raw float8 bytes.
        assert [c.dtype for c in fwd_bwd if c.op == "_allgather_base_"].count(torch.uint8) == 1, fwd_bwd
        # The scales come from one batched amax all-reduce after the optimizer step (7 float8 weights per block),
        # none during forward.
        assert not [c for c in fwd_bwd if "all_reduce" in c.op or "allreduce" in c.op], fwd_bwd
        assert [(c.op, c.numel) for c in optimizer] == [("all_reduce", 7)], optimizer


def test_tp2_x_pp2_on_4_ranks_trains_as_one_process():
    results = _launch(4)["tp2_pp2"]
    # Losses only, as the integration test: the logged gradient norm under TP 2 (with or without the pipeline)
    # differs from one process's by 8e-5 relative at the first step, while every parameter's full gradient agrees
    # to 4e-7. The difference is the norm's own arithmetic: torch's float32 vector_norm on CPU accumulates without
    # pairwise summation (2.6e-5 off a float64 norm on 2M random elements, 1.5e-4 on this model's output
    # gradient), and a TP shard takes the norm of half the elements, so its rounding differs.
    _check_losses(results, _references()["fp32"], FP32_RTOL, grad_norms=False)
    assert all(r["tp_sharded"] for r in results)  # the stages' weights are DTensors over the TP mesh


def test_pp2_with_compile_and_full_ac_trains_as_one_process():
    results = _launch(2)["pp2_compile_full_ac"]
    _check_losses(results, _references()["fp32"], FP32_RTOL)
    for rank in results:
        assert rank["blocks"] == [("CheckpointWrapper", True)]  # checkpointed, then compiled
        assert rank["graphs"] >= 1  # dynamo compiled the block (and the last stage's loss)
