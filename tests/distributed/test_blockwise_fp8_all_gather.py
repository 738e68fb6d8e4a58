"""FSDP2 all-gathers blockwise FP8 weights as E4M3 blocks plus block scales on gloo: the bytes actually handed
to the backend per step, the gathered copy against quantizing the whole weight on one process, the gradients
against the high-precision all-gather, and the fallback where a shard would cut a block."""
from __future__ import annotations

from fractions import Fraction

import torch
import torch.nn as nn
from _collectives import CollectiveLog
from _harness import run_ranks

from torchtitan_lite.components.quantization import Float8BlockwiseConverter
from torchtitan_lite.components.quantization.blockwise_fp8 import quantize_128x128
from torchtitan_lite.protocols.model_converter import ConversionContext

DP = 2
# Per weight element: 1 byte of E4M3 plus a 4-byte float32 scale per 128 x 128 block, against 2 bytes of bf16.
THEORETICAL_RATIO = Fraction(1 + Fraction(4, 128 * 128), 2)  # 0.5001220703125


def _converted(shapes: list[tuple[int, int]], *, fp8_gather: bool, dp_shard: int,
               power_of_2: bool = True) -> nn.Sequential:
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(k, n, bias=False) for n, k in shapes))
    context = ConversionContext(device_type="cpu", param_dtype=torch.bfloat16, autocast=False, fsdp_sharded=True,
                                tp_enabled=False, compile_model=False, seq_len=128, output_module="output", blocks="layers",
                                dp_shard=dp_shard)
    converter = Float8BlockwiseConverter.Config(power_of_2_scales=power_of_2, enable_fsdp_float8_all_gather=fp8_gather)
    converter.build(context=context).convert(model)
    return model


def _shard(model: nn.Sequential) -> nn.Sequential:
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from torchtitan_lite.distributed.float8_allgather import use_byte_view_all_gather

    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in model:
        fully_shard(layer, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    use_byte_view_all_gather(model)  # as apply_fsdp does on CPU
    return model


def _step(model: nn.Sequential, rank: int) -> dict:
    x = torch.randn(DP, 256, 256, generator=torch.Generator().manual_seed(1))[rank]
    log = CollectiveLog()
    with log:
        model(x).float().pow(2).sum().backward()
    gathers = log.of("_allgather_base_")
    return {"gathered_bytes": sum(c.nbytes for c in gathers) * DP, "dtypes": {c.dtype for c in gathers},
            "grads": [p.grad.full_tensor() for p in model.parameters()]}


SHAPES = [(512, 256), (256, 512)]  # 256 and 128 rows per shard: whole 128-row blocks


def _bytes_worker(rank: int, world_size: int) -> dict:
    out = {}
    for fp8_gather in (True, False):
        model = _converted(SHAPES, fp8_gather=fp8_gather, dp_shard=world_size)
        full = [p.detach().clone() for p in model.parameters()]
        _shard(model)
        out[fp8_gather] = _step(model, rank)
        if fp8_gather:
            model[0].unshard()
            gathered = model[0].weight
            expected_data, expected_scale = quantize_128x128(full[0].to(torch.bfloat16), power_of_2=True)
            out["gathered_type"] = type(gathered).__name__
            out["data_equal"] = torch.equal(gathered._data.view(torch.uint8), expected_data.view(torch.uint8))
            out["scale_equal"] = torch.equal(gathered._scale, expected_scale)
            model[0].reshard()
    # Float32 scales (power_of_2_scales=false) are what the shards quantize with, too.
    model = _converted(SHAPES, fp8_gather=True, dp_shard=world_size, power_of_2=False)
    full = model[0].weight.detach().clone()
    _shard(model)[0].unshard()
    expected_data, expected_scale = quantize_128x128(full.to(torch.bfloat16), power_of_2=False)
    out["float32_scales_equal"] = torch.equal(model[0].weight._scale, expected_scale) and torch.equal(
        model[0].weight._data.view(torch.uint8), expected_data.view(torch.uint8))
    out["float32_scales_not_powers_of_2"] = bool((torch.log2(expected_scale) % 1 != 0).any())
    return out


def test_fp8_all_gather_moves_half_the_bytes_bitwise_the_local_quantization_and_the_same_gradients():
    result = run_ranks(_bytes_worker, DP)[0]
    fp8, bf16 = result[True], result[False]
    elements = sum(n * k for n, k in SHAPES)
    # Each layer is gathered twice per step (forward, and again for backward after resharding).
    assert bf16["gathered_bytes"] == 2 * elements * 2 and bf16["dtypes"] == {torch.bfloat16}
    assert fp8["gathered_bytes"] == 2 * (elements + 4 * elements // 128**2) and fp8["dtypes"] == {torch.uint8}
    ratio = Fraction(fp8["gathered_bytes"], bf16["gathered_bytes"])
    assert ratio == THEORETICAL_RATIO and ratio <= Fraction(55, 100)
    # Each rank's shard holds whole blocks, so its local quantization is the whole weight's, bit for bit.
    assert result["gathered_type"] == "BlockwiseGatheredWeight"
    assert result["data_equal"] and result["scale_equal"]
    assert result["float32_scales_equal"] and result["float32_scales_not_powers_of_2"]
    # The high-precision path quantizes the same bf16 blocks after its gather: identical gradients.
    assert all(torch.equal(a, b) for a, b in zip(fp8["grads"], bf16["grads"], strict=True))


def _fallback_worker(rank: int, world_size: int) -> dict:
    # 128 output rows over 2 ranks: 64 rows per shard would cut every block in half.
    model = _shard(_converted([(128, 256)], fp8_gather=True, dp_shard=world_size))
    result = _step(model, rank)
    result["weight_type"] = type(model[0].weight.to_local()).__name__
    return result


def test_a_shard_that_would_cut_a_block_falls_back_to_the_bf16_all_gather():
    result = run_ranks(_fallback_worker, DP)[0]
    assert result["weight_type"] == "Tensor"
    assert result["dtypes"] == {torch.bfloat16} and result["gathered_bytes"] == 2 * 128 * 256 * 2
