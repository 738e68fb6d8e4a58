"""A Llama with blockwise FP8 Linears (emulated, power-of-2 scales) trained under FSDP 2 and FSDP 2 x TP 2 on gloo:
the FP8 weight all-gather halves the bytes FSDP moves for the block Linears, changes nothing in the numbers,
and both layouts train like the same blockwise model on one process (two-sided: the same layout without
blockwise fails the tolerance).

The model is _llama_steps.TINY_128 (dim 256, head_dim 128, FFN 768): every block Linear splits over dp_shard=2 into
whole 128-row blocks. Under FSDP x TP the row-wise wo / w2 gather FP8 (256 rows, 128 per shard); the column-wise
ones have 128 (wq / wk / wv) or 384 (w1 / w3) rows per TP rank, which do not halve into whole blocks, so they are
gathered in the parameter dtype.
"""
from __future__ import annotations

import functools
from fractions import Fraction

import torch
from _harness import run_ranks
from _llama_steps import TINY_128, Run, Tolerance, check_two_sided, single_process_results, train_runs

# Measured on a 2-core AMD EPYC (Zen 5) CPU, 5 steps (losses: max relative difference per step; grads: max over
# parameters of the first gradients' relative norm difference):
#   FSDP 2, bf16: layout 8.8e-5 / 0 (the first step is bit for bit the reference's; later steps differ in the
#       order of the gradient sums, which an FP8 rounding or a power-of-two scale then amplifies); blockwise
#       effect against bf16 alone 1.7e-3 / 7.7e-2.
#   FSDP 2 x TP 2, float32: layout 9.1e-5 / 1.1e-7 (TP's partial sums add in another order); effect 1.5e-3 / 7.7e-2.
FSDP_BF16 = Tolerance(losses=5e-4, grads=1e-6)
FSDP_TP_FP32 = Tolerance(losses=5e-4, grads=1e-5)
STEPS = 5
BLOCKWISE = dict(model="tiny_128", blockwise=True, steps=STEPS)
RUNS = {
    "fsdp2": {
        "blockwise": Run(dp_shard=2, param_dtype="bfloat16", **BLOCKWISE),
        "blockwise_hp_gather": Run(dp_shard=2, param_dtype="bfloat16", **{**BLOCKWISE, "steps": 3},
                                   blockwise_fp8_all_gather=False),
        "bf16": Run(dp_shard=2, param_dtype="bfloat16", model="tiny_128", steps=STEPS),
    },
    "fsdp2_tp2": {
        "blockwise": Run(dp_shard=2, tp=2, **BLOCKWISE),
        "fp32": Run(dp_shard=2, tp=2, model="tiny_128", steps=STEPS),
    },
}


@functools.cache
def _results(layout: str) -> dict[str, dict]:
    runs = RUNS[layout]
    world_size = next(iter(runs.values())).world_size
    results = run_ranks(train_runs, world_size, list(runs.values()), record_step=1, keep_first_grads=True)
    return dict(zip(runs, results[0]))


def _reference(layout: str) -> dict:
    return single_process_results(RUNS[layout]["blockwise"].single_process())


def test_fsdp2_blockwise_trains_like_one_process_and_bf16_alone_does_not():
    got = _results("fsdp2")
    check_two_sided(got["blockwise"], _reference("fsdp2"), got["bf16"], FSDP_BF16)


def test_fsdp2_fp8_all_gather_gives_the_numbers_of_the_high_precision_all_gather():
    got = _results("fsdp2")
    fp8, hp = got["blockwise"], got["blockwise_hp_gather"]
    assert fp8["losses"][:3] == hp["losses"]
    assert all(torch.equal(g, hp["first_grads"][name]) for name, g in fp8["first_grads"].items())


def _block_gathers(result: dict) -> list:
    """Rank 0's all-gathers of a block unit at step 1 (its Linear weights and two norm weights)."""
    return [c for c in result["collectives"]["fwd_bwd"] if c.op == "_allgather_base_" and c.numel > 100_000]


def test_fsdp2_block_all_gather_bytes_of_blockwise_vs_bf16():
    got = _results("fsdp2")
    d, h = TINY_128.dim, 768
    linear = 4 * d * d + 3 * d * h  # wq, wk, wv, wo (256 x 256), w1, w3, w2 (768 x 256)
    norm_bytes = 2 * d * 2 // 2  # two bf16 norm weights, half on each rank
    fp8 = _block_gathers(got["blockwise"])
    bf16 = _block_gathers(got["bf16"])
    # Both blocks in forward, the first again in backward (the last one is not resharded).
    assert len(fp8) == len(bf16) == 3
    assert {c.nbytes for c in bf16} == {linear * 2 // 2 + norm_bytes}
    assert {c.nbytes for c in fp8} == {(linear + 4 * linear // 128**2) // 2 + norm_bytes}
    assert {c.dtype for c in fp8} == {torch.uint8}  # E4M3 blocks, float32 scales and bf16 norms as bytes
    linear_ratio = Fraction(sum(c.nbytes - norm_bytes for c in fp8), sum(c.nbytes - norm_bytes for c in bf16))
    # 1 byte per element plus a 4-byte scale per 128 x 128 block, against 2 bytes.
    assert linear_ratio == Fraction(1 + Fraction(4, 128**2), 2) <= Fraction(55, 100)
    assert Fraction(sum(c.nbytes for c in fp8), sum(c.nbytes for c in bf16)) <= Fraction(55, 100)


def test_fsdp2_tp2_blockwise_trains_like_one_process_and_float32_alone_does_not():
    got = _results("fsdp2_tp2")
    check_two_sided(got["blockwise"], _reference("fsdp2_tp2"), got["fp32"], FSDP_TP_FP32)
    # wo and w2 (2 x 128 x 128-row halves of 256 x 128 TP shards) gather FP8: the block unit moves fewer bytes.
    fp8, fp32 = _block_gathers(got["blockwise"]), _block_gathers(got["fp32"])
    d, h = TINY_128.dim, 768
    rowwise = (d * d // 2 + d * h // 2) // 2  # wo and w2 elements per rank (TP halves the columns, FSDP the rows)
    saved = rowwise * 4 - (rowwise + 4 * rowwise // 128**2)
    assert [c.nbytes for c in fp32] == [c.nbytes + saved for c in fp8]
