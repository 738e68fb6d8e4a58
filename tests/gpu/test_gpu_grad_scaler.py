"""FP16 with dynamic loss scaling on CUDA: an overflow skips the step and halves the scale; clean steps train."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from torchtitan_lite.components.precision import Precision

pytestmark = pytest.mark.gpu


def test_fp16_scaler_skips_overflow_and_trains_on_cuda():
    precision = Precision.Config(param_dtype="float16", loss_scaling="dynamic", init_scale=2.0**10,
                                 growth_interval=1000).build(device="cuda")
    scaler = precision.grad_scaler()
    assert scaler is not None and precision.param_dtype == torch.float16
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 1)).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(128, 64, device="cuda", generator=gen)
    y = x.sum(dim=1, keepdim=True) / 8  # a function the model can learn (unit variance), unlike noise

    def step(poison: bool = False) -> tuple[float, bool]:
        with precision.autocast():
            loss = (model(x).float() - y).pow(2).mean()
        scaler.scale(loss).backward()
        if poison:
            model[0].weight.grad[0, 0] = float("inf")
        scaler.unscale_(opt)
        stepped = scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        return loss.item(), stepped

    first, stepped = step()
    assert stepped
    before = [p.detach().clone() for p in model.parameters()]
    _, stepped = step(poison=True)
    assert stepped is False and scaler.scale_value == 2.0**9 and scaler.skipped_steps == 1
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    losses = [step()[0] for _ in range(60)]
    # float16 autocast on the tensor cores trains as float32 does (float32 on CPU, same steps: the last
    # loss is 0.04% of the first); half the first loss fails only when the scaled updates are wrong.
    assert losses[-1] < 0.5 * first
