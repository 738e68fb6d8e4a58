"""Every precision mode trains a tiny model, on the autocast path and on the FSDP path."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from torchtitan_lite.components.precision import Precision

STEPS = 20


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.LayerNorm(64), nn.Linear(64, 32))


def _train(model: nn.Module, precision: Precision) -> tuple[list[float], torch.dtype]:
    """Memorise one fixed batch with the trainer's step order (scale, unscale, clip, step, update)."""
    torch.manual_seed(1)
    x, target = torch.randn(16, 32), torch.randn(16, 32)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scaler = precision.grad_scaler()
    losses = []
    for _ in range(STEPS):
        with precision.autocast():
            out = model(x)
            loss = (out.float() - target).pow(2).mean()
        (scaler.scale(loss) if scaler else loss).backward()
        if scaler:
            scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        if scaler:
            scaler.step(opt)
            scaler.update()
        else:
            opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, out.dtype


@pytest.mark.parametrize("param_dtype", ["float32", "bfloat16", "float16"])
def test_each_mode_trains_on_the_autocast_path(param_dtype):
    precision = Precision.Config(param_dtype=param_dtype).build(device="cpu", fsdp_enabled=False)
    model = _mlp()
    losses, out_dtype = _train(model, precision)
    assert out_dtype == getattr(torch, param_dtype)
    assert all(p.dtype == torch.float32 for p in model.parameters())  # master weights
    # Memorising one batch of Gaussian targets: 20 AdamW steps at lr 1e-2 reach ~0.02x the initial
    # loss in all three modes; 0.1x leaves room for low-precision noise and still fails if the
    # optimizer never steps (skipped steps) or gradients are lost.
    assert losses[-1] < 0.1 * losses[0], losses


@pytest.mark.parametrize("param_dtype", ["bfloat16", "float16"])
def test_each_mode_trains_on_the_fsdp_path(param_dtype):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    if dist.is_initialized():
        pytest.skip("needs its own single-rank process group")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        precision = Precision.Config(param_dtype=param_dtype).build(device="cpu", fsdp_enabled=True)
        model = _mlp()
        mesh = init_device_mesh("cpu", (1,))
        for layer in (model[0], model[3]):
            fully_shard(layer, mesh=mesh, mp_policy=precision.mp_policy())
        fully_shard(model, mesh=mesh, mp_policy=precision.mp_policy())
        losses, out_dtype = _train(model, precision)
        assert out_dtype == getattr(torch, param_dtype)  # FSDP did the casting; autocast was off
        assert all(p.dtype == torch.float32 for p in model.parameters())
        assert losses[-1] < 0.1 * losses[0], losses  # same bound and reason as the autocast path
    finally:
        dist.destroy_process_group()
