"""Modules that every tensor-parallel rank runs whole inside a head-parallel region (``BlockTPPlan.replicated``):
the style ``apply_tp`` places on them.

Latent attention reads its gathered input through low-rank down-projections (and their norms) that are
small and shared by every head, so TP replicates them rather than splitting them: each rank computes the
same latent, and the column-parallel up-projections expand it into the rank's own heads. Gradients follow
the convention of a partial-sum region (expert_tensor_parallel.py): what flows back into a replicated
module's output on one rank is that rank's share (the sum over its heads), so

* the module's output is handed on as a plain tensor whose gradient is read as a partial sum
  (``to_local(grad_placements=Partial)``), and a plain input is wrapped as replicated with its gradient
  handed back as a share; a gathered DTensor input keeps its own layout, whose backward sums the shares
  (the reduce-scatter or all-reduce of the region's input);
* the parameters are replicated DTensors whose gradients are partial sums over the ranks, as those of the
  sequence-parallel norms are: FSDP reduces them to the parameter's layout, and the gradient norm and the
  optimizer see the sum.

A column-parallel Linear that reads a replicated module's output takes it as a plain tensor whose gradient
stays a share (``ColwiseInPartialRegion``), so nothing is gathered or reduced inside the region.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, distribute_module
from torch.distributed.tensor.parallel import ParallelStyle

from torchtitan_lite.compat import dtensor_from_local


class ReplicatedInRegion(ParallelStyle):
    """Parameters replicated over the TP ranks; tensor inputs as replicated DTensors, the output as a plain
    tensor; the gradients of both read as each rank's share."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        # distribute_module without a partition function replicates every parameter.
        distribute_module(module, device_mesh)
        module.register_forward_pre_hook(lambda _, inputs: _replicated_inputs(inputs, device_mesh))
        module.register_forward_hook(lambda _, __, output: _local_output(output))
        return module


def _replicated_inputs(inputs: tuple[Any, ...], device_mesh: DeviceMesh) -> tuple[Any, ...]:
    return tuple(_as_replicated(x, device_mesh) if isinstance(x, torch.Tensor) else x for x in inputs)


def _as_replicated(x: torch.Tensor, device_mesh: DeviceMesh) -> DTensor:
    if isinstance(x, DTensor):
        if not all(p.is_replicate() for p in x.placements):
            raise ValueError(f"a replicated TP module reads whole activations; got a DTensor placed {x.placements}")
        return x
    return dtensor_from_local(x, device_mesh, (Replicate(),), grad_placements=(Partial(),))


def _local_output(output: Any) -> Any:
    return output.to_local(grad_placements=(Partial(),)) if isinstance(output, DTensor) else output
