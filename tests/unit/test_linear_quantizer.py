"""The low-precision Linear recipes share one base (LinearQuantizer), and the memory layout asks the run's
converter what its Linears cast from and what FSDP gathers, whatever recipe it is."""
from __future__ import annotations

import torch
import torch.nn as nn

from torchtitan_lite.components.precision import Precision
from torchtitan_lite.components.quantization import (
    Float8LinearConverter,
    LinearQuantizer,
    MXLinearConverter,
    linear_quantizer,
)
from torchtitan_lite.config.sections import ModelConfig, ParallelismConfig, TrainingConfig
from torchtitan_lite.memory.layout import model_layout
from torchtitan_lite.protocols.model_converter import ModelConvertersContainer
from torchtitan_lite.resolved_run import resolve_run
from torchtitan_lite.trainer import Trainer


class OneByteGather(LinearQuantizer):
    """A recipe the memory layout has never heard of: casts the master weight, all-gathers 1 byte per element."""

    def swap(self, model: nn.Module, planned: set[str]) -> None:
        pass

    def settings(self) -> str:
        return "one-byte gather"

    @property
    def casts_master_weight(self) -> bool:
        return True

    @property
    def all_gather_itemsize(self) -> int | None:
        return 1


def _run(converter, *, dp_shard: int):
    cfg = Trainer.Config(
        model=ModelConfig(flavor="debug", n_layers=2), training=TrainingConfig(seq_len=64, local_batch_size=2),
        precision=Precision.Config(param_dtype="bfloat16"), parallelism=ParallelismConfig(dp_shard=dp_shard),
        model_converters=ModelConvertersContainer.Config(converters=[converter]),
    )
    return resolve_run(cfg, world_size=dp_shard, device_type="cpu", vocab_size=None)


def _block_linears(layout):
    return [lin for lin in layout.linears if lin.fqn.startswith("layers.")]


def test_both_recipes_are_linear_quantizers():
    for config in (Float8LinearConverter.Config(), MXLinearConverter.Config(kernel="emulated")):
        run = _run(config, dp_shard=1)
        assert isinstance(linear_quantizer(run.converters.converters), LinearQuantizer)


def test_the_layout_takes_each_recipes_answers():
    float8 = model_layout(_run(Float8LinearConverter.Config(enable_fsdp_float8_all_gather=True), dp_shard=2))
    mx = model_layout(_run(MXLinearConverter.Config(kernel="emulated"), dp_shard=2))
    for layout in (float8, mx):
        linears = _block_linears(layout)
        assert len(linears) == 14 and all(lin.converted for lin in linears)  # 7 per block, 2 blocks
    assert all(lin.casts_master_weight for lin in _block_linears(float8))
    assert not any(lin.casts_master_weight for lin in _block_linears(mx))
    assert float8.float8_all_gather and not mx.float8_all_gather
    gathered = {p.fqn: p.gather_itemsize for p in float8.params if p.fqn.startswith("layers.0.attention.wq")}
    assert gathered == {"layers.0.attention.wq.weight": 1}
    assert {p.gather_itemsize for p in mx.params} == {None}


def test_a_new_recipe_is_found_and_asked_by_the_layout():
    # The layout names no recipe class: a third one (here MX's plan with other answers) is taken at its word.
    run = _run(MXLinearConverter.Config(kernel="emulated"), dp_shard=2)
    mx = run.converters.converters[0]
    run.converters.converters[:] = [OneByteGather(mx.config, context=mx.context)]
    assert isinstance(linear_quantizer(run.converters.converters), OneByteGather)
    layout = model_layout(run)
    assert layout.float8_all_gather
    assert all(lin.converted and lin.casts_master_weight for lin in _block_linears(layout))
    assert {p.gather_itemsize for p in layout.params if p.fqn.startswith("layers.1.feed_forward")} == {1}
    assert {p.gather_itemsize for p in layout.params if p.fqn.startswith("tok_embeddings")} == {None}


def test_the_plan_table_is_headed_by_the_recipe_settings():
    run = _run(MXLinearConverter.Config(kernel="emulated"), dp_shard=1)
    quantizer = linear_quantizer(run.converters.converters)
    assert quantizer is not None
    with torch.device("meta"):
        model = run.model_spec.model_cls(run.model_args)
    text = quantizer.explain(model)
    assert text.startswith("mx converter (recipe mxfp8, 32-element blocks with e8m0 scales; MX GEMMs emulated")
    assert "FP8 plan: 14 of 15 Linear layers run in FP8" in text
