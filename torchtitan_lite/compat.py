"""The torch APIs that differ between the supported torch releases (2.11 and newer), in one place.

- ``all_gather_single``: torch 2.13 added ``dist.all_gather_single`` and deprecated
  ``dist.all_gather_into_tensor`` (a FutureWarning on every call); torch 2.11 has only the latter.
  Both gather equal-sized inputs into one output tensor, so the newer name is used where it exists.
- Rowwise-scaled ``torch._scaled_mm`` on CPU: torch 2.11's CPU kernel accepts one scale per tensor
  only and fails with an internal assert ("only supports per-tensor scaling for CPU backend") on
  rowwise scales. ``cpu_scaled_mm_supports_rowwise`` probes the installed torch once, so that callers
  can emulate rowwise FP8 there (``Float8LinearConfig.emulate``) instead of crashing mid-step.
- ``dtensor_from_local``: torch 2.13's ``DTensor.from_local`` takes ``grad_placements`` (the layout the
  local tensor's gradient is read in, as ``to_local(grad_placements=)`` does the other way); torch 2.11's
  does not (TypeError) and always hands the gradient back in the forward layout, which for a replicated
  tensor whose gradient is a partial sum means an all-reduce the caller did not want. Where the keyword
  is missing, an autograd step with torch 2.13's backward (redistribute the gradient to
  ``grad_placements``, return its local tensor) wraps the plain ``from_local``.
- Compiling MX casts for CPU: torchao's MX cast reinterprets its uint8 block scales as float8_e8m0fnu and back.
  torch 2.13's inductor materialises the scales first, so the reinterpretation is a view of a buffer; torch
  2.11's fuses it into the consumer's kernel as a bitcast, which its C++ code generator cannot write (no C++
  type for float8_e8m0fnu: "missing from DTYPE_TO_CPP"). ``inductor_cpu_mx_cast_error`` compiles one cast
  once (a few seconds, only asked when MX is compiled for CPU) so that the converter refuses the combination
  before training instead of failing inside the first compiled step.
- A CPU ``torch._scaled_mm`` that is oneDNN's reference kernel (no FP8 kernel for this CPU; measured 10 s for
  one 2048x256x768 GEMM on an Intel Xeon with AMX) is replaced at import, before any FP8 GEMM runs, by one at
  matmul speed with the same result (cpu_scaled_mm.py). Every module that builds FP8 layers imports this one.
"""
from __future__ import annotations

import functools
import inspect
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._dtensor_spec import DTensorSpec
from torch.distributed.tensor._redistribute import redistribute_local_tensor
from torch.distributed.tensor.placement_types import Placement

from torchtitan_lite.cpu_scaled_mm import use_fast_cpu_scaled_mm

use_fast_cpu_scaled_mm()  # one probe per process: a millisecond, ~0.3 s where the kernel is the slow one

_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def all_gather_single(output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup | None = None,
                      async_op: bool = False) -> dist.Work | None:
    """Gather every rank's ``input_tensor`` (same size on all ranks) into ``output_tensor``."""
    return _all_gather_single(output_tensor, input_tensor, group=group, async_op=async_op)


_FROM_LOCAL_TAKES_GRAD_PLACEMENTS = "grad_placements" in inspect.signature(DTensor.from_local).parameters


def dtensor_from_local(local: torch.Tensor, device_mesh: DeviceMesh, placements: Sequence[Placement],
                       grad_placements: Sequence[Placement]) -> DTensor:
    """``DTensor.from_local(local, device_mesh, placements, run_check=False, grad_placements=grad_placements)``."""
    if _FROM_LOCAL_TAKES_GRAD_PLACEMENTS:
        return DTensor.from_local(local, device_mesh, placements, run_check=False, grad_placements=grad_placements)
    return _FromLocalWithGradPlacements.apply(local, device_mesh, tuple(placements), tuple(grad_placements))


class _FromLocalWithGradPlacements(torch.autograd.Function):
    """``DTensor.from_local`` whose backward is torch 2.13's with ``grad_placements`` (torch/distributed/tensor/_api.py,
    _FromTorchTensor.backward); the forward is the plain ``from_local`` run without autograd."""

    @staticmethod
    def forward(ctx: Any, local: torch.Tensor, device_mesh: DeviceMesh, placements: tuple[Placement, ...],
                grad_placements: tuple[Placement, ...]) -> DTensor:
        ctx.device_mesh, ctx.grad_placements = device_mesh, grad_placements
        ctx.set_materialize_grads(False)
        return DTensor.from_local(local, device_mesh, placements, run_check=False)

    @staticmethod
    def backward(ctx: Any, grad: DTensor | None) -> tuple[torch.Tensor | None, None, None, None]:
        if grad is None:
            return None, None, None, None
        if tuple(grad.placements) == ctx.grad_placements:
            return grad.to_local(), None, None, None
        target = DTensorSpec(ctx.device_mesh, ctx.grad_placements, tensor_meta=grad._spec.tensor_meta)
        return redistribute_local_tensor(grad._local_tensor, grad._spec, target), None, None, None


@functools.cache
def inductor_cpu_mx_cast_error() -> str | None:
    """Why inductor cannot compile torchao's MX cast (to MXFP8 and back) for CPU with this torch, or None."""
    from torchao.prototype.mx_formats.config import ScaleCalculationMode
    from torchao.prototype.mx_formats.mx_tensor import get_fp_scale, to_mx

    def cast(x: torch.Tensor) -> torch.Tensor:
        scale, data = to_mx(x, torch.float8_e4m3fn, 32, ScaleCalculationMode.RCEIL)
        return data.to(torch.bfloat16).reshape(-1, 32) * get_fp_scale(scale).reshape(-1, 1).to(torch.bfloat16)

    x = torch.randn(4, 32, dtype=torch.bfloat16, generator=torch.Generator().manual_seed(0))
    try:
        torch.compile(cast, backend="inductor", fullgraph=True)(x)
    except Exception as error:  # noqa: BLE001 - any failure means the cast cannot be compiled here
        return f"{type(error).__name__}: {str(error).strip().splitlines()[0]}"
    return None


@functools.cache
def cpu_scaled_mm_supports_rowwise() -> bool:
    """Whether the installed torch's CPU ``torch._scaled_mm`` accepts one scale per row / column."""
    a = torch.ones(16, 16).to(torch.float8_e4m3fn)
    b = torch.ones(16, 16).to(torch.float8_e4m3fn).t()  # _scaled_mm wants the second operand column-major
    try:
        out = torch._scaled_mm(a, b, scale_a=torch.ones(16, 1), scale_b=torch.ones(1, 16), out_dtype=torch.bfloat16)
    except (RuntimeError, NotImplementedError):
        return False
    return bool(torch.all(out == 16.0))


def float8_recipe_needs_emulation(recipe_name: str, device_type: str) -> str | None:
    """Why FP8 recipe ``recipe_name`` must be emulated on ``device_type`` with this torch, or None.

    Only rowwise recipes on a CPU whose ``_scaled_mm`` lacks rowwise scaling are affected; CUDA
    capability is checked separately (the converter refuses GPUs without FP8 tensor cores).
    """
    if device_type != "cpu" or recipe_name == "tensorwise" or cpu_scaled_mm_supports_rowwise():
        return None
    return (f"torch {torch.__version__}'s CPU torch._scaled_mm supports per-tensor scales only, so the "
            f"{recipe_name!r} recipe's per-row scales are emulated in high precision on CPU (same FP8 "
            f"rounding of inputs, weights and gradients; the GEMM itself runs in the original dtype)")
