"""DeepSeek-V3 under tensor parallelism (latent attention split by heads with its down-projections replicated,
the dense block's SwiGLU Megatron-split, the MoE expert tensor parallel), alone, with FSDP and with expert
parallelism, reproduces the single-process training: losses, first gradients, every expert bias and the
router statistics; its TP checkpoint loads on one process.

The tiny model (_moe_steps.TINY_DEEPSEEK_V3: 4 heads, low-rank queries, YaRN, one dense block then one MoE
block with 8 experts in 4 groups and a shared expert, group-limited sigmoid routing, balance loss and
expert-bias update on) trains as the Qwen3-MoE TP tests' does (_moe_steps), float32, from one initial state
on every layout. Measured on a 2-core AMD EPYC CPU, AdamW ("losses": max relative difference per step;
"grads": max over parameters of the relative norm difference of the first gradients):

  run                                  steps  losses / grads
  TP 2, low-rank queries               10     9.1e-8 / 4.0e-7
  TP 2, full-rank queries (wq)         5      8.6e-8 / 4.1e-7
  TP 2 without SP / loss parallel      3      0 / 3.7e-7
  TP 2, full / selective op AC         3      8.1e-8 / 4.0e-7
  TP 2, float8 tensorwise attention   3      8.1e-8 / 4.8e-7   (float8's effect: 1.8e-5 / 0.13)
  FSDP 2 x TP 2 (4 ranks)              5      2.5e-7 / 3.7e-7
  EP 2 x TP 2 (4 ranks)                5      2.5e-7 / 3.7e-7   (reference: FSDP 2 x TP 2's)

Negative control (measured once, by hand, 3 steps): reading the replicated modules' output gradient as whole
instead of as each rank's share of its heads (``to_local()`` without ``grad_placements=(Partial(),)`` in
replicated_modules.py, so that the down-projections and their norms get only their own heads' gradient)
moves the first gradients by 0.97 relative (0.86 with full-rank queries) and the losses by 8.5e-5.
"""
from __future__ import annotations

import functools

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
from torch.distributed.tensor import DTensor

# float32: a layout only changes the order of float32 sums (the heads' partial products, the reduce-scatters
# of the input gradients and of the experts' partial outputs, the down-projections' gradients summed over the
# ranks); measured below 4.2e-7 relative, so 1e-5 leaves margin while a gradient counted twice or missed is
# off by tens of percents (the negative control above).
FP32 = Tolerance(losses=1e-5, grads=1e-5)

TP2 = {
    "low_rank_q": Run(tp=2, steps=10, model="deepseek_v3"),
    "full_rank_q": Run(tp=2, steps=5, model="deepseek_v3_full_rank_q"),
    "no_sp_no_loss_parallel": Run(tp=2, steps=3, model="deepseek_v3", sequence_parallel=False, loss_parallel=False),
    "full_ac": Run(tp=2, steps=3, model="deepseek_v3", ac_mode="full"),
    "selective_op_ac": Run(tp=2, steps=3, model="deepseek_v3", ac_mode="selective", ac_option="op"),
    # torchao float8 on every attention Linear, the replicated down-projections included.
    "fp8_tensorwise": Run(tp=2, steps=3, model="deepseek_v3", float8="tensorwise"),
}
# float8 tensorwise: between the layout's 8.1e-8 / 4.8e-7 and float8's effect (float32 on one process against
# the float8 reference) of 1.8e-5 / 0.13, 3 steps.
FP8_TENSORWISE = Tolerance(losses=1e-6, grads=1e-4)
CHECKPOINTED = Run(tp=2, model="deepseek_v3")


def _placements(rank: int, world_size: int) -> dict[str, tuple[str, tuple[int, ...]]]:
    """Parameter -> (placements, local shape) of the TP 2 model, for the parts of latent attention."""
    model = build(TP2["low_rank_q"])[0]
    attention = {f"layers.1.attention.{n}.weight" for n in ("wq_a", "q_norm", "wq_b", "wkv_a", "kv_norm", "wkv_b", "wo")}
    return {name: (str(p.placements), tuple(p.to_local().shape)) for name, p in model.named_parameters()
            if name in attention and isinstance(p, DTensor)}


def _tp2_worker(rank: int, world_size: int, dump: str) -> dict:
    """One 2-rank launch: every TP 2 run; the placements; TP 2 trained SAVED_STEPS steps, saved and continued."""
    after, saved_bias, _ = train_save_continue(rank, world_size, dump, CHECKPOINTED)
    return {"trained": train_runs(rank, world_size, list(TP2.values())), "placements": _placements(rank, world_size),
            "after": after, "saved_bias": saved_bias}


@pytest.fixture(scope="module")
def tp2(tmp_path_factory) -> dict:
    dump = str(tmp_path_factory.mktemp("deepseek_v3_tp2"))
    ranks = run_ranks(_tp2_worker, 2, dump)
    return {"dump": dump, "ranks": ranks,
            "trained": {name: [rank["trained"][i] for rank in ranks] for i, name in enumerate(TP2)}}


@functools.cache
def reference(run: Run) -> dict:
    return run_single(run)


@pytest.mark.parametrize("name", ["low_rank_q", "full_rank_q", "no_sp_no_loss_parallel", "full_ac", "selective_op_ac"])
def test_tp2_float32_matches_single_process(tp2, name):
    ranks = tp2["trained"][name]
    ref = reference(TP2[name])
    for got in ranks:
        diff = differences(got, ref)
        assert diff["losses"] < FP32.losses and diff["grads"] < FP32.grads, diff
    assert_same_routing(ranks, ref)


def test_tp2_float8_tensorwise_attention_matches_single_process_and_float32_does_not(tp2):
    got = tp2["trained"]["fp8_tensorwise"][0]
    check_two_sided(got, reference(TP2["fp8_tensorwise"]), precision_off=tp2["trained"]["low_rank_q"][0],
                    tol=FP8_TENSORWISE)


def test_tp2_splits_latent_attention_by_heads_and_replicates_its_down_projections(tp2):
    # 4 heads of qk head dim 16 + 8 and v head dim 16; q_lora_rank = kv_lora_rank = 32, rope dim 8, dim 64.
    assert tp2["ranks"][0]["placements"] == {
        "layers.1.attention.wq_a.weight": ("(Replicate(),)", (32, 64)),
        "layers.1.attention.q_norm.weight": ("(Replicate(),)", (32,)),
        "layers.1.attention.wkv_a.weight": ("(Replicate(),)", (40, 64)),
        "layers.1.attention.kv_norm.weight": ("(Replicate(),)", (32,)),
        "layers.1.attention.wq_b.weight": ("(Shard(dim=0),)", (48, 32)),  # 2 of 4 heads x 24
        "layers.1.attention.wkv_b.weight": ("(Shard(dim=0),)", (64, 32)),  # 2 of 4 heads x (16 + 16)
        "layers.1.attention.wo.weight": ("(Shard(dim=1),)", (64, 32)),  # 2 of 4 heads x 16
    }


def test_tp2_checkpoint_loads_on_one_process_and_training_continues(tp2):
    run = Run(model="deepseek_v3")
    model, dims, precision, config = build(run)  # the initial weights, overwritten by the load
    optimizer = optimizer_for(model)
    ckpt = checkpointer(tp2["dump"], states(model, optimizer))
    assert ckpt.load() == SAVED_STEPS
    ckpt.close()
    rank0 = tp2["ranks"][0]
    assert set(rank0["saved_bias"]) == {"1"}  # the MoE block's expert bias (block 0 is dense)
    for layer, bias in rank0["saved_bias"].items():
        assert torch.equal(model.layers[layer].moe.expert_bias, bias)
    batches = global_batches(SAVED_STEPS + 2)
    resumed = [train_step(run, model, optimizer, dims, precision, config, batches[step])[0]
               for step in range(SAVED_STEPS, SAVED_STEPS + 2)]
    # Weights and Adam moments resharded from the head / hidden-dim splits to whole tensors: the same losses up
    # to float32 summation order.
    assert resumed == pytest.approx(rank0["after"], rel=FP32.losses)


def test_fsdp2_x_tp2_and_ep2_x_tp2_on_4_ranks_match_single_process():
    fsdp_tp = Run(dp_shard=2, tp=2, steps=5, model="deepseek_v3")
    ep_tp = MoERun(dp_shard=2, ep=2, tp=2, steps=5, model="deepseek_v3")
    ranks = run_ranks(train_runs, 4, [fsdp_tp, ep_tp])
    # Each data rank's half of the batch in turn under FSDP on one process; EP changes where an expert's rows
    # are computed, not what, so it has the same reference.
    ref = reference(fsdp_tp)
    for i in range(2):
        results = [r[i] for r in ranks]
        diff = differences(results[0], ref)
        assert diff["losses"] < FP32.losses and diff["grads"] < FP32.grads, (i, diff)
        assert len({tuple(r["losses"]) for r in results}) == 1  # every rank reports the same global losses
        assert_same_routing(results, ref)


# --- blockwise FP8 under TP 2 -----------------------------------------------------------------------------------
#
# _moe_steps.TINY_DEEPSEEK_V3_128: every converted Linear's TP shard holds whole 128-wide tiles, the replicated
# down-projections (wq_a, wkv_a) are blockwise Linears with replicated weights. Measured, one step (first
# gradients; the losses of the first step are equal to the bit): TP 2 blockwise against one-process blockwise
# 3.9e-2, TP 2 float32 against it 9.3e-2. The difference of the layout is the replicated down-projections'
# (3.5e-2 to 3.9e-2 on wq_a / wkv_a, 1.4e-2 to 1.7e-2 on wq_b / wkv_b, the attention norms upstream): their
# weight-gradient GEMM quantizes each rank's share of the output gradient (the sum over its heads) in 1x128
# tiles, where one process quantizes the sum. Over 3 steps: losses 1.5e-5 against blockwise's effect of 2.9e-3.
#
# A tolerance between 3.9e-2 and 9.3e-2 cannot tell a small error from the layout's own rounding, so the two-sided
# check runs with the replicated down-projections kept in high precision (filter_fqns), on TP 2 and on its reference
# alike: every blockwise GEMM then quantizes the same tiles on both (each TP shard holds whole tiles) and the layout
# changes only the order of float32 sums. Measured: first gradients 3.0e-7 from that reference, float32 TP 2 7.0e-2
# from it (blockwise's effect); BLOCKWISE_TP's 1e-3 sits 3,000x above the one and 70x below the other. The run with
# blockwise down-projections keeps a one-sided bound: its first step's losses equal to the bit and its first
# gradients within BLOCKWISE_REPLICATED_GRADS (5x its 3.9e-2; a gradient counted twice or missed is off by 1).
BLOCKWISE_TP = Tolerance(losses=1e-5, grads=1e-3)
BLOCKWISE_REPLICATED_GRADS = 0.2
DOWN_PROJECTIONS = ("wq_a", "wkv_a")
BLOCKWISE_RUNS = [Run(tp=2, steps=1, model="deepseek_v3_128", blockwise=True), Run(tp=2, steps=1, model="deepseek_v3_128"),
                  Run(tp=2, steps=1, model="deepseek_v3_128", blockwise=True, float8_keep_hp=DOWN_PROJECTIONS)]


# In the default suite: the only run of blockwise FP8 with DeepSeek-V3's replicated down-projections under TP (~7-12 s).
def test_tp2_blockwise_fp8_with_replicated_down_projections_trains_like_one_process_and_float32_does_not():
    blockwise, fp32, down_projections_hp = run_ranks(train_runs, 2, BLOCKWISE_RUNS)[0]
    hp_ref = reference(BLOCKWISE_RUNS[2])
    check_two_sided(down_projections_hp, hp_ref, precision_off=fp32, tol=BLOCKWISE_TP)
    diff = differences(blockwise, reference(BLOCKWISE_RUNS[0]))
    assert diff["losses"] == 0 and diff["grads"] < BLOCKWISE_REPLICATED_GRADS, diff
