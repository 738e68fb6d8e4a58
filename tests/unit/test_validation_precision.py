"""validation.low_precision: FP8 Linears as trained, or the high-precision policy (plain Linears)."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torchao.float8 import Float8LinearConfig, convert_to_float8_training

from torchtitan_lite.components.loss import cross_entropy_sum
from torchtitan_lite.components.quantization.low_precision_linears import high_precision_linears, low_precision_linears
from torchtitan_lite.components.validate import Validator

VOCAB = 32


class TinyLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(VOCAB, 64)
        self.hidden = nn.Linear(64, 128, bias=False)
        self.out = nn.Linear(128, VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.out(torch.relu(self.hidden(self.emb(tokens))))


def _data() -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(1)
    return [(torch.randint(0, VOCAB, (4, 16), generator=gen), torch.randint(0, VOCAB, (4, 16), generator=gen))
            for _ in range(3)]


def _loss(model: nn.Module, *, low_precision: bool) -> float:
    config = Validator.Config(enable=True, steps=-1, low_precision=low_precision)
    return config.build(loss_fn=cross_entropy_sum, device="cpu", dataloader=_data()).validate([model], step=1)


def test_high_precision_validation_equals_the_unconverted_model_and_fp8_differs():
    plain = TinyLM()
    converted = convert_to_float8_training(copy.deepcopy(plain), config=Float8LinearConfig.from_recipe_name(
        "tensorwise"), module_filter_fn=lambda _m, fqn: fqn == "hidden")
    assert [fqn for fqn, _ in low_precision_linears(converted)] == ["hidden"]

    fp8 = _loss(converted, low_precision=True)
    high = _loss(converted, low_precision=False)
    # Same weights, same F.linear calls in the same order: bitwise equal to the model never converted.
    assert high == _loss(plain, low_precision=True)
    # e4m3 keeps 3 mantissa bits: the FP8 loss moves, but by well under 1% of a ~3.5 nat loss.
    assert fp8 != high and fp8 == pytest.approx(high, rel=1e-2)
    # The FP8 forward is back after validation: running the module again gives the FP8 number.
    assert _loss(converted, low_precision=True) == fp8


def test_high_precision_linears_restores_the_fp8_forward_even_on_error():
    model = convert_to_float8_training(TinyLM(), module_filter_fn=lambda _m, fqn: fqn == "hidden")
    fp8_forward = type(model.hidden).forward
    with pytest.raises(RuntimeError, match="boom"), high_precision_linears([model]) as switched:
        assert switched == 1 and model.hidden.forward.__func__ is nn.Linear.forward
        raise RuntimeError("boom")
    assert "forward" not in vars(model.hidden) and type(model.hidden).forward is fp8_forward


def _fp8_config(**converter):
    import config_registry

    cfg = config_registry.get("llama3_debug_fp8")
    for key, value in converter.items():
        setattr(cfg.model_converters.converters[0], key, value)
    cfg.validation.low_precision = False
    return cfg


def test_layouts_that_hand_linears_float8_data_refuse_high_precision_validation():
    from torchtitan_lite.resolved_run import resolve_run

    gathered = _fp8_config(enable_fsdp_float8_all_gather=True)
    with pytest.raises(ValueError, match="cannot be honoured with enable_fsdp_float8_all_gather: FSDP all-gathers "
                                         "the weights as float8"):
        resolve_run(gathered, world_size=2, device_type="cpu")
    resolve_run(gathered, world_size=1, device_type="cpu")  # no FSDP sharding: no float8 all-gather, fine

    tensor_parallel = _fp8_config()
    tensor_parallel.parallelism.tp = 2
    with pytest.raises(ValueError, match="tensor parallelism and the tensorwise float8 recipe: its inputs and output "
                                         "gradients are cast to float8 before the tensor-parallel communication"):
        resolve_run(tensor_parallel, world_size=2, device_type="cpu")
    rowwise = _fp8_config(recipe_name="rowwise")
    rowwise.parallelism.tp = 2
    resolve_run(rowwise, world_size=2, device_type="cpu")


def test_a_compiled_model_switches_between_fp8_and_high_precision_validation():
    torch._dynamo.reset()
    plain = TinyLM()
    converted = convert_to_float8_training(copy.deepcopy(plain), module_filter_fn=lambda _m, fqn: fqn == "hidden")
    converted.compile(backend="aot_eager", fullgraph=True)
    fp8 = _loss(converted, low_precision=True)
    # The swapped forward is guarded by the compiled graph: the high-precision pass gets its own graph
    # instead of reusing the FP8 one, and the FP8 graph is reused afterwards.
    assert _loss(converted, low_precision=False) == _loss(plain, low_precision=True)
    assert _loss(converted, low_precision=True) == fp8
