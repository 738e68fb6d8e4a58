"""Which blockwise Linears FSDP gathers as FP8 blocks (every shard must hold whole 128-row blocks) and why the
others are not, in the plan and the launch log; tensor-parallel shards that would cut a block are an error."""
from __future__ import annotations

import logging
import re

import pytest
import torch

from models.llama3.model import Llama3ModelArgs, Transformer
from models.llama3.parallelize import LLAMA3_PARALLEL_PLAN
from torchtitan_lite.components.quantization import Float8BlockwiseConverter
from torchtitan_lite.components.quantization.blockwise_weight import BlockwiseShardWeight, fp8_all_gather_obstacle
from torchtitan_lite.protocols.model_converter import ConversionContext

DEBUG = Llama3ModelArgs(dim=256, n_layers=2, n_heads=8, n_kv_heads=4, vocab_size=2048, multiple_of=256)
"""llama3_debug's Linear shapes: wq / wo 256 x 256, wk / wv 128 x 256, w1 / w3 768 x 256, w2 256 x 768."""


def _meta_llama() -> Transformer:
    with torch.device("meta"):
        return Transformer(DEBUG)


def _converter(*, dp_shard: int = 1, tp: int = 1, kernel: str = "auto", **config) -> Float8BlockwiseConverter:
    context = ConversionContext(device_type="cpu", param_dtype=torch.bfloat16, autocast=False,
                                fsdp_sharded=dp_shard > 1, tp_enabled=tp > 1, compile_model=False, seq_len=128,
                                output_module="output", blocks="layers", dp_shard=dp_shard, tp=tp,
                                tp_shard_dim=LLAMA3_PARALLEL_PLAN.tp_shard_dim)
    return Float8BlockwiseConverter.Config(kernel=kernel, **config).build(context=context)  # type: ignore[arg-type]


@pytest.mark.parametrize("out_features, in_features, dp_shard, tp, tp_dim, obstacle", [
    (256, 256, 2, 1, None, ""),
    (256, 256, 1, 1, None, "dp_shard=1: FSDP gathers nothing"),
    (768, 256, 2, 1, None, ""),
    (128, 256, 2, 1, None, "128 rows / dp_shard=2 = 64 rows per FSDP shard, not whole 128-row blocks"),
    (384, 256, 2, 1, None, "384 rows / dp_shard=2 = 192 rows per FSDP shard"),
    (256, 256, 3, 1, None, "256 rows do not split evenly over dp_shard=3 (FSDP pads the last shard)"),
    (512, 256, 2, 2, 0, ""),  # column-wise: 256 rows per TP rank, 128 per FSDP shard
    (256, 256, 2, 2, 0, "128 rows per TP rank / dp_shard=2 = 64 rows per FSDP shard"),
    (256, 256, 2, 2, 1, ""),  # row-wise: TP splits the columns, FSDP the 256 rows
])
def test_obstacle_rule(out_features, in_features, dp_shard, tp, tp_dim, obstacle):
    got = fp8_all_gather_obstacle(out_features, in_features, dp_shard=dp_shard, tp=tp, tp_shard_dim=tp_dim)
    assert (got == "") == (obstacle == "") and obstacle in got


def test_llama3_debug_under_fsdp2_gathers_fp8_except_wk_wv_and_says_why(caplog):
    converter = _converter(dp_shard=2)
    model = _meta_llama()
    with caplog.at_level(logging.INFO, logger="torchtitan_lite"):
        converter.convert(model)
    text = ("FSDP all-gather (dp_shard=2): 10 of 14 blockwise Linears gather FP8 blocks (1.00024 bytes/element: E4M3 "
            "+ a float32 scale per block); the rest the parameter dtype\n"
            "  FP8: layers.*.attention.wq, layers.*.attention.wo, layers.*.feed_forward.w1, layers.*.feed_forward.w2, "
            "layers.*.feed_forward.w3\n"
            "  high precision: layers.*.attention.wk, layers.*.attention.wv (128 rows / dp_shard=2 = 64 rows per FSDP "
            "shard, not whole 128-row blocks (a block would span two ranks))")
    assert text in caplog.text
    assert converter.explain(_meta_llama()).endswith(text)
    block = model.layers["0"]
    assert isinstance(block.attention.wq.weight.data, BlockwiseShardWeight)
    assert not isinstance(block.attention.wk.weight.data, BlockwiseShardWeight)
    per_linear = converter.all_gather_per_linear(converter.plan or [])
    assert per_linear["layers.0.attention.wq"] == (1 + 4 / 128**2, "E4M3 + a float32 scale per block")
    assert per_linear["layers.0.attention.wk"][0] is None


@pytest.mark.parametrize("config, kernel, why", [
    ({"enable_fsdp_float8_all_gather": False}, "auto", "enable_fsdp_float8_all_gather=false"),
])
def test_gather_turned_off_says_so_for_every_linear(config, kernel, why):
    converter = _converter(dp_shard=2, kernel=kernel, **config)
    model = _meta_llama()
    converter.convert(model)
    assert converter.fp8_all_gather_text(converter.plan or []).startswith(
        "FSDP all-gather (dp_shard=2): 0 of 14 blockwise Linears gather FP8 blocks")
    assert f"({why})" in converter.fp8_all_gather_text(converter.plan or [])
    assert not isinstance(model.layers["0"].attention.wq.weight.data, BlockwiseShardWeight)


def test_tensor_parallel_shard_that_cuts_a_block_is_an_error_naming_linear_dims_tp_and_fix():
    with pytest.raises(ValueError, match=re.escape(
            "parallelism.tp=2 would cut 4 module(s) whose shards must hold whole 1x128 tiles and 128x128 weight blocks "
            "(the split dim / tp a multiple of 128): model_converters.converters[float8_blockwise]: "
            "layers.{0,1}.attention.wk (256 -> 128, column-wise: out_features 128 / 2 = 64); layers.{0,1}.attention.wv "
            "(256 -> 128, column-wise: out_features 128 / 2 = 64). Fix: use parallelism.tp in [1], or keep exactly these "
            "in high precision: add 'attention.wk', 'attention.wv' to model_converters.converters[float8_blockwise]."
            "filter_fqns")):
        _converter(tp=2).convert(_meta_llama())


def test_tensor_parallel_with_aligned_shards_converts_and_composes_with_fsdp():
    converter = _converter(tp=2, dp_shard=2, filter_fqns=["wk", "wv"])
    model = _meta_llama()
    converter.convert(model)
    reasons = converter.fp8_all_gather_reasons(converter.plan or [])
    # Row-wise wo / w2: TP splits the columns, FSDP the 256 rows; column-wise wq (128 rows per TP rank) and
    # w1 / w3 (384) cannot be cut into two whole 128-row halves.
    assert {fqn for fqn, why in reasons.items() if not why} == {f"layers.{i}.{m}" for i in (0, 1)
                                                                for m in ("attention.wo", "feed_forward.w2")}
    assert reasons["layers.0.feed_forward.w1"].startswith("384 rows per TP rank / dp_shard=2 = 192 rows")


def test_validation_in_high_precision_is_refused_when_fsdp_gathers_fp8_blocks():
    from torchtitan_lite.components.precision import Precision
    from torchtitan_lite.components.validate import Validator
    from torchtitan_lite.config.sections import ModelConfig, ParallelismConfig, TrainingConfig
    from torchtitan_lite.protocols.model_converter import ModelConvertersContainer
    from torchtitan_lite.resolved_run import resolve_run
    from torchtitan_lite.trainer import Trainer

    def config(fp8_gather: bool) -> Trainer.Config:
        return Trainer.Config(
            model=ModelConfig(flavor="debug", n_layers=2), training=TrainingConfig(seq_len=128, local_batch_size=2),
            precision=Precision.Config(param_dtype="bfloat16"), parallelism=ParallelismConfig(dp_shard=2),
            validation=Validator.Config(enable=True, low_precision=False),
            model_converters=ModelConvertersContainer.Config(converters=[
                Float8BlockwiseConverter.Config(enable_fsdp_float8_all_gather=fp8_gather)]))

    # The Linears would never see their high-precision weights: FSDP hands them FP8 blocks.
    with pytest.raises(ValueError, match="cannot be honoured with enable_fsdp_float8_all_gather: FSDP all-gathers the "
                                         "weights as float8"):
        resolve_run(config(True), world_size=2, device_type="cpu", vocab_size=None)
    resolve_run(config(False), world_size=2, device_type="cpu", vocab_size=None)


def test_gathered_weight_reads_as_its_dequantized_blocks_outside_the_blockwise_gemm():
    from torchtitan_lite.components.quantization.blockwise_fp8 import dequantize_128x128, quantize_128x128
    from torchtitan_lite.components.quantization.blockwise_weight import BlockwiseGatheredWeight

    weight = torch.randn(256, 128, generator=torch.Generator().manual_seed(0))
    data, scale = quantize_128x128(weight, power_of_2=True)
    gathered = BlockwiseGatheredWeight(data, scale, torch.bfloat16)
    assert gathered.shape == (256, 128) and gathered.dtype == torch.bfloat16
    # FSDP's as_strided to the full size and nn.Parameter's detach keep the blocks.
    assert torch.as_strided(gathered, (256, 128), (128, 1)).detach()._data is data
    assert torch.equal(gathered * 1, dequantize_128x128(data, scale).to(torch.bfloat16))
