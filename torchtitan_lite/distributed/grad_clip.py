"""Gradient-norm clipping for a model whose gradients are DTensors on different meshes, or plain tensors.

`torch.nn.utils.clip_grad_norm_` cannot combine norms of DTensors living on different meshes (or mixed
with plain tensors). Here the norm of each group of gradients sharing a mesh is reduced to a plain tensor
(`full_tensor()`, one collective per mesh) and the groups are combined locally, as torchtitan does.
"""
from __future__ import annotations

import math
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor


@torch.no_grad()
def clip_grad_norm_(
    parameters: Iterable[torch.Tensor],
    max_norm: float,
    *,
    norm_type: float = 2.0,
    foreach: bool | None = None,
    pp_mesh: DeviceMesh | None = None,
) -> torch.Tensor:
    """Scale gradients in place so that their global `norm_type`-norm is at most `max_norm`.

    Returns the global norm before clipping as a plain float32 tensor (for logging). max_norm=0 only
    computes the norm. pp_mesh, when given, combines the norms of pipeline stages holding other parameters.
    A non-finite norm is returned as is; the gradients are then left unscaled for the caller to handle.
    """
    if max_norm < 0:
        raise ValueError(f"training.max_norm={max_norm} must be >= 0 (0 disables clipping)")
    parameters = list(parameters)
    grads = [p.grad for p in parameters if p.grad is not None]
    norm_type = float(norm_type)
    total = _total_norm(grads, norm_type, foreach)
    if pp_mesh is not None:
        if math.isinf(norm_type):
            dist.all_reduce(total, op=dist.ReduceOp.MAX, group=pp_mesh.get_group())
        else:
            total = total ** norm_type
            dist.all_reduce(total, op=dist.ReduceOp.SUM, group=pp_mesh.get_group())
            total = total ** (1.0 / norm_type)
    if max_norm > 0:
        # Decided on the device (a non-finite norm scales by 1): an ``if`` on the norm would wait for it.
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        _scale_(grads, torch.where(torch.isfinite(total), coef, torch.ones_like(coef)), foreach)
    return total


def _scale_(grads: list[torch.Tensor], coef: torch.Tensor, foreach: bool | None) -> None:
    # Scaling is elementwise, so each rank scales its local shards; this also mixes freely DTensors of
    # different meshes and plain tensors, which one foreach call over the DTensors themselves cannot.
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    for g in grads:
        local = g.to_local() if isinstance(g, DTensor) else g  # under no_grad: the local shard itself
        by_device.setdefault(local.device, []).append(local)
    for device, tensors in by_device.items():
        factor = coef.to(device)
        if foreach is False:
            for t in tensors:
                t.mul_(factor)
        else:
            torch._foreach_mul_(tensors, factor)


def _total_norm(grads: list[torch.Tensor], norm_type: float, foreach: bool | None) -> torch.Tensor:
    groups: dict[object, list[torch.Tensor]] = {}
    for g in grads:
        key = g.device_mesh if isinstance(g, DTensor) else ("plain", g.device)
        groups.setdefault(key, []).append(g)
    if not groups:
        return torch.zeros((), dtype=torch.float32)
    norms = []
    for group in groups.values():
        norm = torch.nn.utils.get_total_norm(group, norm_type, error_if_nonfinite=False, foreach=foreach)
        if isinstance(norm, DTensor):
            # Partial over the sharded mesh dims: materialising it runs the reduction.
            norm = norm.full_tensor()
        norms.append(norm.float())
    device = norms[0].device
    stacked = torch.stack([n.to(device) for n in norms])
    if math.isinf(norm_type):
        return stacked.max()
    return stacked.pow(norm_type).sum().pow(1.0 / norm_type)
