"""clip_grad_norm_ on gradients that are DTensors on different meshes and placements, plus plain tensors."""
from __future__ import annotations

import math

import torch
from _harness import run_ranks
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

from torchtitan_lite.distributed.grad_clip import clip_grad_norm_


def _full_grads() -> list[torch.Tensor]:
    torch.manual_seed(0)  # identical full gradients on every rank
    return [torch.randn(shape) * scale for shape, scale in zip([(8, 4), (6, 2), (4,), (3, 3)], [1.0, 2.0, 0.5, 3.0])]


def _params(full: list[torch.Tensor]):
    world = torch.distributed.get_world_size()
    flat = init_device_mesh("cpu", (world,))
    grid = init_device_mesh("cpu", (world, 1), mesh_dim_names=("dp", "tp"))
    full = [g.clone() for g in full]  # a replicated DTensor may share storage with its source
    grads = [
        distribute_tensor(full[0], flat, [Shard(0)]),
        distribute_tensor(full[1], grid, [Shard(0), Replicate()]),
        distribute_tensor(full[2], flat, [Replicate()]),
        full[3],  # a plain tensor, replicated on every rank
    ]
    params = []
    for g in grads:
        p = torch.nn.Parameter(torch.zeros_like(g))
        p.grad = g
        params.append(p)
    return params


def _worker(rank: int, world_size: int) -> dict:
    full = _full_grads()
    out = {}
    for norm_type in (2.0, math.inf):
        expected = torch.linalg.vector_norm(torch.cat([g.flatten() for g in full]), norm_type)
        params = _params(full)
        total = clip_grad_norm_(params, max_norm=1.0, norm_type=norm_type)
        clipped = [p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad for p in params]
        scale = 1.0 / (float(expected) + 1e-6)
        out[norm_type] = {
            "total": float(total), "expected": float(expected), "plain": type(total) is torch.Tensor,
            "clip_error": max(float((c - g * scale).abs().max()) for c, g in zip(clipped, full)),
        }
    params = _params(full)
    clip_grad_norm_(params, max_norm=0.0)
    out["untouched"] = all(
        torch.equal(p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad, g) for p, g in zip(params, full)
    )
    return out


def test_norm_and_clipping_over_mixed_meshes_placements_and_plain_tensors():
    for result in run_ranks(_worker, 2):
        for norm_type in (2.0, math.inf):
            r = result[norm_type]
            # Sums of squares of a few dozen float32 values: rounding far below 1e-6 relative.
            assert abs(r["total"] - r["expected"]) <= 1e-6 * r["expected"], (norm_type, r)
            assert r["plain"], "the returned norm must be a plain tensor for logging"
            assert r["clip_error"] < 1e-6
        assert result["untouched"]
