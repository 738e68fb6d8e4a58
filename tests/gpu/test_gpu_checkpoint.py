"""DCP save/load of a CUDA FP8 model with its optimizer: a resumed run continues with the same losses."""
from __future__ import annotations

import pytest
import torch
from _gpu_helpers import float8_converter, mlp, needs_fp8

from torchtitan_lite.components.checkpoint import CheckpointManager, ModelWrapper
from torchtitan_lite.components.optimizer import OptimizersContainer

pytestmark = [pytest.mark.gpu, needs_fp8]


def _fresh(seed: int):
    model = mlp(seed=seed, dtype=torch.float32)
    float8_converter(param_dtype=torch.float32).convert(model)
    # The trainer's optimizer container: its state dict creates Adam's moments before a load fills them.
    return model, OptimizersContainer.Config(lr=1e-3).build(model_parts=[model])


def _steps(model, opt, x: torch.Tensor, n: int) -> list[float]:
    losses = []
    for _ in range(n):
        loss = model(x).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _manager(dump, model, opt) -> CheckpointManager:
    return CheckpointManager.Config(enable=True, interval=1).build(
        dump_folder=str(dump), states={"model": ModelWrapper(model), "optimizer": opt})


def test_dcp_resume_of_a_cuda_float8_model_repeats_the_losses(tmp_path):
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(256, 256, device="cuda", generator=gen)
    model, opt = _fresh(seed=0)
    _steps(model, opt, x, 3)
    _manager(tmp_path, model, opt).save(3, force=True)
    continued = _steps(model, opt, x, 3)

    resumed_model, resumed_opt = _fresh(seed=1)  # different weights until the checkpoint is loaded
    assert _manager(tmp_path, resumed_model, resumed_opt).load() == 3
    assert resumed_model[0].weight.device.type == "cuda"
    resumed = _steps(resumed_model, resumed_opt, x, 3)
    # Same weights, optimizer moments and data through the same kernels: the same numbers; 1e-6 relative
    # leaves room only for a nondeterministic reduction order, never for a lost or stale state.
    assert resumed == pytest.approx(continued, rel=1e-6)
