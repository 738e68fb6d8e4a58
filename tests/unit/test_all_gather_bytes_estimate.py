"""--estimate-memory and --dry-run say how many bytes per weight element FSDP all-gathers for each recipe, and why:
bf16 2, tensorwise float8 1, blockwise FP8 1 + 4/16384 (the block scales) where shards hold whole blocks, rowwise 2
(the input-gradient GEMM needs the weight scaled along its other axis)."""
from __future__ import annotations

import math

import pytest

from torchtitan_lite.components.precision import Precision
from torchtitan_lite.components.quantization import Float8BlockwiseConverter, Float8LinearConverter
from torchtitan_lite.config.sections import ModelConfig, ParallelismConfig, TrainingConfig
from torchtitan_lite.memory.estimate import estimate_memory_text
from torchtitan_lite.memory.layout import model_layout
from torchtitan_lite.protocols.model_converter import ModelConvertersContainer
from torchtitan_lite.resolved_run import resolve_run
from torchtitan_lite.trainer import Trainer

BF16 = "every parameter 2 (bfloat16)"
TENSORWISE = "14 tensorwise Linears 1 (float8 with one tensorwise scale (all-reduced amax)); other parameters 2 (bfloat16)"
ROWWISE = ("14 rowwise Linears 2 (bfloat16: rowwise: per-row scales do shard along dim 0 with the weight, but the "
           "input-gradient GEMM (dX = dY W) needs the weight scaled along its other axis, so one gathered float8 copy "
           "cannot serve both GEMMs); other parameters 2 (bfloat16)")
BLOCKWISE = ("10 blockwise Linears 1.00024 (E4M3 + a float32 scale per block); 4 blockwise Linears 2 (bfloat16: 128 "
             "rows / dp_shard=2 = 64 rows per FSDP shard, not whole 128-row blocks (a block would span two ranks)); "
             "other parameters 2 (bfloat16)")


def _run(converters: list, *, dp_shard: int = 2):
    cfg = Trainer.Config(
        model=ModelConfig(flavor="debug", n_layers=2), training=TrainingConfig(seq_len=128, local_batch_size=2),
        precision=Precision.Config(param_dtype="bfloat16"), parallelism=ParallelismConfig(dp_shard=dp_shard),
        model_converters=ModelConvertersContainer.Config(converters=converters),
    )
    return resolve_run(cfg, world_size=dp_shard, device_type="cpu", vocab_size=None)


@pytest.mark.parametrize("converters, text", [
    ([], BF16),
    ([Float8LinearConverter.Config(recipe_name="tensorwise", enable_fsdp_float8_all_gather=True)], TENSORWISE),
    ([Float8LinearConverter.Config(recipe_name="rowwise")], ROWWISE),
    ([Float8BlockwiseConverter.Config()], BLOCKWISE),
])
def test_all_gather_bytes_per_element_per_recipe(converters, text):
    run = _run(converters)
    line = f"FSDP all-gather bytes per weight element: {text}"
    assert model_layout(run).all_gather_text == line
    assert estimate_memory_text(run).endswith("\n" + line)


def test_blockwise_gathered_bytes_count_the_block_scales():
    layout = model_layout(_run([Float8BlockwiseConverter.Config()]))
    wq = next(p for p in layout.params if p.fqn == "layers.0.attention.wq.weight")
    wk = next(p for p in layout.params if p.fqn == "layers.0.attention.wk.weight")
    assert wq.gather_itemsize == 1 + 4 / 128**2 and wk.gather_itemsize is None
    assert math.ceil(wq.tp_numel * wq.gather_itemsize) == 256 * 256 + 4 * 4  # 4 blocks of 128 x 128, 4 bytes each


def test_no_fsdp_no_all_gather_line():
    assert model_layout(_run([Float8BlockwiseConverter.Config()], dp_shard=1)).all_gather_text == ""
