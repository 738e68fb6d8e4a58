"""Float8 training wrappers never reach the saved state; fp8 and MX models and plain ones load each other's checkpoints."""
from __future__ import annotations

import os

import pytest
import torch
import torch.nn as nn
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from torchtitan_lite.components.checkpoint import CheckpointManager, ModelWrapper
from torchtitan_lite.components.checkpoint.stateful import plain_tensor

float8 = pytest.importorskip("torchao.float8")
from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor  # noqa: E402


def tiny(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(64, 128, bias=False), nn.ReLU(), nn.Linear(128, 64, bias=False))


def fp8(model: nn.Module) -> nn.Module:
    config = float8.Float8LinearConfig(enable_fsdp_float8_all_gather=True)
    return float8.convert_to_float8_training(model, config=config)


def manager(dump, model, **cfg):
    cfg = {"enable": True, "interval": 1, **cfg}
    return CheckpointManager.Config(**cfg).build(dump_folder=str(dump), states={"model": ModelWrapper(model)})


def save_and_load_weights_only(tmp_path, model: nn.Module) -> dict:
    """The model's checkpoint at step 1, converted to one torch.save file and loaded with weights_only=True."""
    manager(tmp_path, model).save(1, force=True)
    out = tmp_path / "plain.pt"
    dcp_to_torch_save(os.path.join(tmp_path, "checkpoint", "step-1"), out)
    return torch.load(out, weights_only=True)


def test_float8_weights_save_as_plain_tensors_loadable_weights_only(tmp_path):
    model = fp8(tiny(0))
    assert type(model[0].weight) is WeightWithDynamicFloat8CastTensor  # the case under test
    state = ModelWrapper(model).state_dict()
    assert {type(v) for v in state.values()} == {torch.Tensor}
    loaded = save_and_load_weights_only(tmp_path, model)
    assert {type(v) for v in loaded["model"].values()} == {torch.Tensor}
    assert torch.equal(loaded["model"]["0.weight"], model[0].weight._tensor)


@pytest.mark.parametrize("save_fp8, load_fp8", [(True, False), (False, True)])
def test_float8_and_plain_models_load_each_others_checkpoints(tmp_path, save_fp8, load_fp8):
    src = fp8(tiny(0)) if save_fp8 else tiny(0)
    manager(tmp_path, src).save(1, force=True)
    dst = fp8(tiny(1)) if load_fp8 else tiny(1)
    assert manager(tmp_path, dst).load() == 1
    weight_type = WeightWithDynamicFloat8CastTensor if load_fp8 else nn.Parameter
    for i in (0, 2):
        assert type(dst[i].weight) is weight_type  # loading keeps the destination's own kind of weight
        assert torch.equal(plain_tensor("w", dst[i].weight), plain_tensor("w", src[i].weight))


def test_unwrap_picks_the_data_tensor_beside_a_precomputed_scale():
    data = torch.randn(32, 16)
    mm_config = fp8(tiny(0))[0].linear_mm_config
    wrapped = WeightWithDynamicFloat8CastTensor(data, mm_config, torch.float8_e4m3fn, torch.tensor(0.5))
    assert len(wrapped.__tensor_flatten__()[0]) == 2
    unwrapped = plain_tensor("layers.0.w1.weight", wrapped)
    assert type(unwrapped) is torch.Tensor and torch.equal(unwrapped, data)


def mx(model: nn.Module) -> nn.Module:
    from _conversion import context

    from torchtitan_lite.components.quantization import MXLinearConverter

    converter = MXLinearConverter.Config().build(context=context(compile_model=False))  # eager: no compile check
    for i in (0, 2):
        model[i] = converter.mx_linear(model[i])
    return model


def test_mx_weights_save_as_plain_tensors_loadable_weights_only(tmp_path):
    from torchtitan_lite.components.quantization.mx_linear import MXLinear

    model = mx(tiny(0))
    assert isinstance(model[0], MXLinear)  # the case under test
    with torch.no_grad():  # one MX forward, so the saved state is that of a model that has run
        model(torch.randn(2, 32, 64))
    loaded = save_and_load_weights_only(tmp_path, model)
    assert {type(v) for v in loaded["model"].values()} == {torch.Tensor}
    assert set(loaded["model"]) == {"0.weight", "2.weight"}
    assert torch.equal(loaded["model"]["2.weight"], model[2].weight.detach())


@pytest.mark.parametrize("save_mx, load_mx", [(True, False), (False, True)])
def test_mx_and_plain_models_load_each_others_checkpoints(tmp_path, save_mx, load_mx):
    from torchtitan_lite.components.quantization.mx_linear import MXLinear

    src = mx(tiny(0)) if save_mx else tiny(0)
    manager(tmp_path, src).save(1, force=True)
    dst = mx(tiny(1)) if load_mx else tiny(1)
    assert manager(tmp_path, dst).load() == 1
    for i in (0, 2):
        assert isinstance(dst[i], MXLinear) == load_mx  # loading keeps the destination's own modules
        assert torch.equal(dst[i].weight, src[i].weight)
