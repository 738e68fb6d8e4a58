"""The loss scaler's overflow decision is all-reduced: an overflow on one rank makes every rank skip and
back off (or spend hysteresis) together, so the replicas never diverge."""
from __future__ import annotations

import torch
from _harness import run_ranks
from torch import nn

from torchtitan_lite.components.grad_scaler import GradScaler


def _one_step_per_scaler(rank: int, world_size: int) -> dict[str, dict]:
    results = {}
    for name, scaler in [("dynamic", GradScaler(init_scale=256.0)),
                         ("hysteresis", GradScaler(init_scale=256.0, hysteresis=2)),
                         ("static", GradScaler(init_scale=256.0, dynamic=False))]:
        torch.manual_seed(0)
        model, x = nn.Linear(8, 8), torch.randn(4, 8)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        before = model.weight.detach().clone()
        scaler.scale(model(x).pow(2).mean()).backward()
        if rank == 1:  # only rank 1 overflows: rank 0 must still skip, or the replicas would diverge
            model.weight.grad[0, 0] = float("inf")
        scaler.unscale_(opt)
        stepped = scaler.step(opt)
        scaler.update()
        results[name] = {"stepped": stepped, "scale": scaler.scale_value, "skipped": scaler.skipped_steps,
                         "hysteresis_left": scaler.hysteresis_left, "unchanged": torch.equal(before, model.weight)}
    return results


def test_an_overflow_on_one_rank_makes_every_rank_skip():
    for result in run_ranks(_one_step_per_scaler, 2, timeout_s=120):
        assert result == {
            "dynamic": {"stepped": False, "scale": 128.0, "skipped": 1, "hysteresis_left": 0, "unchanged": True},
            # Both ranks spend the same hysteresis: the scale stays, the tracker agrees.
            "hysteresis": {"stepped": False, "scale": 256.0, "skipped": 1, "hysteresis_left": 1, "unchanged": True},
            "static": {"stepped": False, "scale": 256.0, "skipped": 1, "hysteresis_left": 1, "unchanged": True},
        }
