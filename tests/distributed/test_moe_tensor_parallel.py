"""Qwen3-MoE under tensor parallelism (attention split by heads, the MoE expert tensor parallel), alone and with
expert parallelism, reproduces the single-process training: losses, first gradients, every expert bias and
the router statistics; its checkpoints load on one process.

The tiny model (_moe_steps.TINY_MOE) trains with the balance loss and the expert-bias update on, and with a
shared expert, so that every gradient path of the split MoE (routed experts, shared expert, combine
weights into the router, balance loss into the router) is compared. Measured on a 2-core AMD EPYC (Zen 5)
CPU, 10 AdamW steps ("layout": the run against its single-process reference; "effect": the same run
without the precision under test, i.e. float32, against that reference; losses: max relative difference
per step; grads: max over parameters of the relative norm difference of the first gradients):

  run                          layout losses / grads     effect losses / grads
  TP 2 float32                 9.1e-8 / 3.0e-7           -   (no SP: 0 / 3.0e-7; full / op AC: 8.1e-8 / 3.0e-7)
  FSDP 2 x TP 2 float32        9.7e-8 / 3.0e-7           -
  TP 2 float8 tensorwise attn  1.8e-7 / 2.1e-7           3.6e-4 / 0.105
  TP 2 float8 rowwise attn     4.5e-5 / 7.1e-3           2.6e-4 / 0.085
  EP 2 x TP 2 float32          9.7e-8 / 3.0e-7           -   (4 ranks; reference: FSDP 2 x TP 2's)

EP 2 x TP 2 (dp_shard 2 split into ep 2, tp 2 inner): each TP rank exchanges the gathered tokens with the EP
rank of its own tp coordinate and computes its hidden slice of its 2 local experts. Its losses equal FSDP 2 x
TP 2's over the first 3 steps to the bit and its first expert gradients differ by at most 1.2e-10 absolute
(an expert's rows from both data ranks in one GEMM); dropping the rows sent to the other EP rank
(_moe_ep_steps._DroppingDispatcher) moves the losses by 1.7e-4 and the first gradients by 0.60 relative over
3 steps, far outside FP32.

Row-wise float8 scales the output projection's gradient per row over its input features, which TP splits,
so the layout rounds differently from one process; tensorwise float8 moves the same scaled values through
float8 TP communication and stays float32-close. bfloat16 has no two-sided test: TP 2 bf16 measured 1.6e-4
from its bf16 reference and 1.3e-4 from float32 (each rank rounds its partial sums; as Llama 3's TP 2).
"""
from __future__ import annotations

import functools
import os

import pytest
import torch
from _harness import run_ranks
from _llama_steps import Run, Tolerance, check_two_sided, differences, global_batches
from _moe_steps import (
    SAVED_STEPS,
    MoERun,
    assert_same_routing,
    build,
    checkpointer,
    optimizer_for,
    run_single,
    states,
    train_runs,
    train_save_continue,
    train_step,
)

# float32: a layout only changes the order of float32 sums (TP partial products, the reduce-scatter of the
# experts' partial outputs and of the input gradients); measured below 3.1e-7 relative, so 1e-5 leaves
# margin while a gradient path counted twice or missed (e.g. the router's share of the input gradient
# summed over the TP ranks without its 1 / tp) is off by percents.
FP32 = Tolerance(losses=1e-5, grads=1e-5)
# float8 tensorwise: between the layout's 1.8e-7 / 2.1e-7 and float8's effect of 3.6e-4 / 0.105.
FP8_TENSORWISE = Tolerance(losses=1e-5, grads=1e-4)
# float8 rowwise: between the layout's 4.5e-5 / 7.1e-3 and float8's effect of 2.6e-4 / 0.085.
FP8_ROWWISE = Tolerance(losses=1e-4, grads=3e-2)

TP2 = {
    "fp32": Run(tp=2, steps=10),
    "no_sp_no_loss_parallel": Run(tp=2, sequence_parallel=False, loss_parallel=False, steps=4),
    "full_ac": Run(tp=2, ac_mode="full", steps=4),
    "selective_op_ac": Run(tp=2, ac_mode="selective", ac_option="op", steps=4),
    "fp8_tensorwise": Run(tp=2, float8="tensorwise", steps=10),
    "fp8_rowwise": Run(tp=2, float8="rowwise", steps=10),
}


@functools.cache
def tp2_results() -> dict[str, list[dict]]:
    """Every TP 2 run, trained in one 2-rank launch: run name -> both ranks' results."""
    per_rank = run_ranks(train_runs, 2, list(TP2.values()))
    return {name: [rank[i] for rank in per_rank] for i, name in enumerate(TP2)}


@functools.cache
def reference(run: Run) -> dict:
    return run_single(run)


def _prefix(result: dict, steps: int) -> dict:
    return dict(result, losses=result["losses"][:steps])


@pytest.mark.parametrize("name", ["fp32", "no_sp_no_loss_parallel", "full_ac", "selective_op_ac"])
def test_tp2_float32_matches_single_process(name):
    ranks = tp2_results()[name]
    ref = reference(TP2[name])
    for got in ranks:
        diff = differences(got, ref)
        assert diff["losses"] < FP32.losses and diff["grads"] < FP32.grads, diff
    assert_same_routing(ranks, ref)


def test_fsdp2_x_tp2_on_4_ranks_matches_single_process():
    run = Run(dp_shard=2, tp=2, steps=10)
    ranks = run_ranks(train_runs, 4, [run])
    results = [r[0] for r in ranks]
    ref = reference(run)  # each data rank's half of the batch in turn under FSDP on one process
    diff = differences(results[0], ref)
    assert diff["losses"] < FP32.losses and diff["grads"] < FP32.grads, diff
    assert len({tuple(r["losses"]) for r in results}) == 1  # every rank reports the same global losses
    assert_same_routing(results, ref)


@pytest.mark.parametrize(("name", "tol"), [("fp8_tensorwise", FP8_TENSORWISE), ("fp8_rowwise", FP8_ROWWISE)])
def test_tp2_float8_attention_matches_single_process_and_float32_does_not(name, tol):
    results = tp2_results()
    run = TP2[name]
    check_two_sided(results[name][0], reference(run), precision_off=results["fp32"][0], tol=tol)


# --- checkpoint: saved at TP 2, loaded on one process --------------------------------------------------

def tp2_train_save_continue(rank: int, world_size: int, dump: str) -> tuple[list[float], dict]:
    """Train SAVED_STEPS steps at TP 2, save, train two more: (the two losses after the save, saved biases)."""
    after, saved_bias, _ = train_save_continue(rank, world_size, dump, Run(tp=2))
    return after, saved_bias


def test_tp2_checkpoint_loads_on_one_process_and_training_continues(tmp_path):
    dump = str(tmp_path)
    (after, saved_bias), _ = run_ranks(tp2_train_save_continue, 2, dump)
    assert os.path.isdir(tmp_path / "checkpoint" / f"step-{SAVED_STEPS}")

    run = Run()
    model, dims, precision, config = build(run)  # the initial weights, overwritten by the load
    optimizer = optimizer_for(model)
    ckpt = checkpointer(dump, states(model, optimizer))
    assert ckpt.load() == SAVED_STEPS
    ckpt.close()
    for layer, bias in saved_bias.items():  # the expert biases survive (a persistent buffer, replicated over TP)
        assert torch.equal(model.layers[layer].moe.expert_bias, bias)
    batches = global_batches(SAVED_STEPS + 2)
    resumed = [train_step(run, model, optimizer, dims, precision, config, batches[step])[0]
               for step in range(SAVED_STEPS, SAVED_STEPS + 2)]
    # Weights and Adam moments resharded from the hidden-dim / head splits to whole tensors: the same losses
    # up to float32 summation order.
    assert resumed == pytest.approx(after, rel=FP32.losses)


# --- expert parallelism x tensor parallelism: EP 2 x TP 2 on 4 ranks -------------------------------------

EP2_TP2 = MoERun(dp_shard=2, ep=2, tp=2, steps=10)


def _ep2_tp2_worker(rank: int, world_size: int, dump: str) -> dict:
    """One 4-rank launch: EP 2 x TP 2 trained 10 steps; then trained SAVED_STEPS steps, saved, and continued."""
    trained = train_runs(rank, world_size, [EP2_TP2])[0]
    after, saved_bias, saved_state = train_save_continue(rank, world_size, dump, MoERun(dp_shard=2, ep=2, tp=2))
    return {"trained": trained, "after": after, "saved_bias": saved_bias, "saved_state": saved_state}


def test_ep2_x_tp2_on_4_ranks_matches_single_process_and_its_checkpoint_loads_on_one_process(tmp_path):
    ranks = run_ranks(_ep2_tp2_worker, 4, str(tmp_path))
    results = [r["trained"] for r in ranks]
    # The reference is FSDP 2 x TP 2's (each data rank's half of the batch in turn): EP changes where an
    # expert's rows are computed, not what.
    ref = reference(Run(dp_shard=2, tp=2, steps=10))
    for got in results:
        diff = differences(got, ref)
        assert diff["losses"] < FP32.losses and diff["grads"] < FP32.grads, diff
    assert len({tuple(r["losses"]) for r in results}) == 1  # every rank reports the same global losses
    assert_same_routing(results, ref)

    # The checkpoint holds the global tensors (experts split 2 x 2 on the (ep, tp) mesh, sharded by FSDP):
    # one process loads every weight bit for bit, the biases, and continues as the 4 ranks did.
    model, dims, precision, config = build(Run())
    optimizer = optimizer_for(model)
    ckpt = checkpointer(str(tmp_path), states(model, optimizer))
    assert ckpt.load() == SAVED_STEPS
    ckpt.close()
    saved_state = ranks[0]["saved_state"]
    assert saved_state["layers.0.moe.experts.w1"].shape == (4, 32, 64)
    loaded = model.state_dict()
    for name, value in saved_state.items():
        assert torch.equal(loaded[name], value), name
    for layer, bias in ranks[0]["saved_bias"].items():
        assert torch.equal(model.layers[layer].moe.expert_bias, bias)
    batches = global_batches(SAVED_STEPS + 2)
    resumed = [train_step(Run(), model, optimizer, dims, precision, config, batches[step])[0]
               for step in range(SAVED_STEPS, SAVED_STEPS + 2)]
    assert resumed == pytest.approx(ranks[0]["after"], rel=FP32.losses)
