"""The torch APIs that differ between the supported torch releases (2.11 and newer), in one place.

- ``all_gather_single``: torch 2.13 added ``dist.all_gather_single`` and deprecated
  ``dist.all_gather_into_tensor`` (a FutureWarning on every call); torch 2.11 has only the latter.
  Both gather equal-sized inputs into one output tensor, so the newer name is used where it exists.
- Rowwise-scaled ``torch._scaled_mm`` on CPU: torch 2.11's CPU kernel accepts one scale per tensor
  only and fails with an internal assert ("only supports per-tensor scaling for CPU backend") on
  rowwise scales. ``cpu_scaled_mm_supports_rowwise`` probes the installed torch once, so that callers
  can emulate rowwise FP8 there (``Float8LinearConfig.emulate``) instead of crashing mid-step.
"""
from __future__ import annotations

import functools

import torch
import torch.distributed as dist

_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def all_gather_single(output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup | None = None,
                      async_op: bool = False) -> dist.Work | None:
    """Gather every rank's ``input_tensor`` (same size on all ranks) into ``output_tensor``."""
    return _all_gather_single(output_tensor, input_tensor, group=group, async_op=async_op)


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
