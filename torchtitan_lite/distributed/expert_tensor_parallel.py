"""Tensor parallelism of an MoE feed-forward ("expert tensor parallelism"): the styles ``apply_tp`` places on
the modules a family's ``MoETPPlan`` names.

Inside the MoE layer every TP rank holds the whole (gathered) sequence and a slice of every expert's hidden
dim, so each rank's output is a partial sum. The gradients follow the same convention: what reaches the
layer's input on one rank is that rank's share, and the region's reduce-scatter (the backward of its
all-gather) sums the shares. Every piece inside must therefore hand back a share, not a whole gradient:

* the routed experts: their activations pass through their slice of the hidden dim only, so the input
  gradient of each rank is its share by construction, and each weight slice gets its exact gradient;
* the shared experts: column-parallel Linears whose input gradient is left as a partial sum
  (``ColwiseInPartialRegion``; the stock style would all-reduce it, counting it ``tp`` times);
* the router runs replicated on the same tokens, so the routing (top-k, tokens per expert) is the same on
  every rank. Two of its gradients are not shares and are fixed at its edges (``ReplicatedRouter``): the
  gradient of the combine weights is a partial sum (each rank combines its partial expert outputs), so it
  is all-reduced ([tokens, top_k], small) before it enters the router; after that, and with the balance
  loss's own gradient, the router's gradients are whole on every rank: the gate weight's is exact and the
  same everywhere (a replicated parameter), and its input gradient is divided by ``tp`` so that the
  region's reduce-scatter counts it once.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.distributed._functional_collectives as funcol
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle
from torch.distributed.tensor.placement_types import Placement

from torchtitan_lite.compat import dtensor_from_local


class GatheredRegion(ParallelStyle):
    """A module every TP rank runs on the whole sequence and whose output is a partial sum over the ranks:
    its first input goes from the residual layout to replicated (all-gather under sequence parallelism),
    its output from partial back to the residual layout (reduce-scatter; all-reduce without sequence
    parallelism). The module sees plain tensors; the gradient of its input is read as a partial sum."""

    def __init__(self, residual: Placement) -> None:
        super().__init__()
        self.residual = residual

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        residual = (self.residual,)

        def gather(_: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
            x, *rest = args
            if not isinstance(x, DTensor):
                x = DTensor.from_local(x, device_mesh, residual, run_check=False)
            whole = x.redistribute(placements=(Replicate(),)).to_local(grad_placements=(Partial(),))
            return (whole, *rest)

        def reduce(_: nn.Module, args: tuple[Any, ...], out: torch.Tensor) -> torch.Tensor:
            partial = DTensor.from_local(out, device_mesh, (Partial(),), run_check=False)
            return partial.redistribute(placements=residual).to_local()

        module.register_forward_pre_hook(gather)
        module.register_forward_hook(reduce)
        return module


class ColwiseInPartialRegion(ColwiseParallel):
    """Column-parallel Linear inside a ``GatheredRegion``: its (replicated) input's gradient stays a partial
    sum, which the region's reduce-scatter sums with the other shares."""

    @staticmethod
    def _prepare_input_fn(input_layouts: Any, desired_input_layouts: Any, mod: nn.Module, inputs: Any,
                          device_mesh: DeviceMesh) -> Any:
        x = inputs[0]
        if isinstance(x, DTensor):
            raise TypeError(f"{type(mod).__name__} inside a gathered TP region expects a plain tensor input")
        return dtensor_from_local(x, device_mesh, (Replicate(),), grad_placements=(Partial(),))


class ExpertTensorParallel(ParallelStyle):
    """Routed experts with 3-D weights split along every expert's hidden dim: w1 / w3 [E, hidden, dim] by
    rows (Shard(1)), w2 [E, dim, hidden] by columns (Shard(2)). The experts compute on their local slices
    (``GroupedExperts.local_weights``), so each rank's output is a partial sum."""

    SHARD_DIMS = {"w1": 1, "w3": 1, "w2": 2}

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def partition(_: str, mod: nn.Module, mesh: DeviceMesh) -> None:
            if mod is not module:
                return
            for name, dim in self.SHARD_DIMS.items():
                param = getattr(mod, name)
                mod.register_parameter(name, nn.Parameter(distribute_tensor(param, mesh, [Shard(dim)]),
                                                          requires_grad=param.requires_grad))

        return distribute_module(module, device_mesh, partition)


class ReplicatedRouter(ParallelStyle):
    """A router run by every TP rank on the same gathered tokens: parameters replicated; the combine weights'
    gradient all-reduced and the input's divided by the TP degree (see the module docstring)."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        # distribute_module without a partition function replicates every parameter.
        distribute_module(module, device_mesh)
        group = device_mesh.get_group()
        degree = device_mesh.size()

        def scale_input_grad(_: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
            x, *rest = args
            return (_ScaleGrad.apply(x, 1.0 / degree), *rest)

        def sum_weights_grad(_: nn.Module, args: tuple[Any, ...], routing: Any) -> Any:
            return dataclasses.replace(routing, weights=_AllReduceGrad.apply(routing.weights, group))

        module.register_forward_pre_hook(scale_input_grad)
        module.register_forward_hook(sum_weights_grad)
        return module


class _ScaleGrad(torch.autograd.Function):
    """Identity forward; the gradient multiplied by ``scale``."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad * ctx.scale, None


class _AllReduceGrad(torch.autograd.Function):
    """Identity forward; the gradient summed over ``group`` (Megatron's copy into the tensor-parallel region)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return funcol.wait_tensor(funcol.all_reduce(grad.contiguous(), "sum", ctx.group)), None
