"""A CPU ``torch._scaled_mm`` at matmul speed where the installed kernel runs far slower.

torch's CPU ``_scaled_mm`` (the FP8 GEMM the tensorwise and rowwise recipes call) goes through oneDNN. On
some CPUs oneDNN has no FP8 kernel and runs its reference implementation instead: measured on an Intel Xeon
with AMX (torch 2.13), one 2048x256x768 GEMM took 10 s (0.07 s through this module) and the first training
step of a 4-block debug model 14 minutes; on an AMD EPYC (AVX2) the same kernel runs at matmul speed.
``use_fast_cpu_scaled_mm`` times the kernel once per process and, where it runs below ``MIN_GFLOPS``,
registers a CPU implementation of ``aten::_scaled_mm`` that computes the same result from the same FP8
operands: every product of two FP8 values is exact, the products are summed, scaled and biased in float64
and the result is rounded once to ``out_dtype``. Float64 makes the result independent of the order of the
sum: float32 GEMMs block the sum by the operands' shapes, so a tensor-parallel shard of a GEMM and the whole
GEMM would disagree in the last bit, and the next FP8 cast turns such bits into flipped roundings (measured:
the TP 2 vs one-process loss gap of a float8 run grew from 1.7e-7 to 4.6e-5 with float32 sums). Nothing about
the FP8 rounding of the operands changes; CUDA keeps its kernels.
"""
from __future__ import annotations

import functools
import logging
import time
import warnings
from collections.abc import Callable

import torch

logger = logging.getLogger(__name__)

MIN_GFLOPS = 0.25
"""The native kernel is replaced when the probe's best of ``_REPEATS`` runs below this rate. Measured at the
probe's shape on an Intel Xeon with AMX: the reference kernel 0.04 GFLOP/s (53 ms, 2 threads), a float64 GEMM
11-18 GFLOP/s idle and 0.58 under load 1.8. The bound sits 6x above the reference kernel and far below a real
kernel, and the best of several runs keeps a busy machine from choosing differently from one process to the
next (a TP run and its one-process reference must compute alike)."""
_REPEATS = 3
_PROBE = 128
"""M = N = K of the probe: 4 MFLOP, ~0.05 s a call through the reference kernel, under a millisecond otherwise."""

_library: torch.library.Library | None = None
"""Holds the registration: dropping the Library would remove the kernel."""
_why: str | None = None


def replacement_note() -> str | None:
    """What an FP8 run on CPU should say about its GEMMs: the reason the kernel was replaced, or None."""
    return _why


def scaled_mm_float64(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor,
                      bias: torch.Tensor | None = None, scale_result: torch.Tensor | None = None,
                      out_dtype: torch.dtype | None = None, use_fast_accum: bool = False) -> torch.Tensor:
    """``torch._scaled_mm`` for float8 operands with one scale per tensor or per row of ``a`` / column of ``b``,
    computed in float64 from the FP8 values and rounded once. ``use_fast_accum`` changes nothing on CPU."""
    del use_fast_accum
    m, n = a.shape[0], b.shape[1]
    _check_scale("scale_a", scale_a, (m, 1))
    _check_scale("scale_b", scale_b, (1, n))
    out_dtype = out_dtype or a.dtype
    if out_dtype.itemsize == 1:
        raise NotImplementedError("torchtitan_lite's CPU _scaled_mm returns bfloat16, float16 or float32, not "
                                  f"{out_dtype}: an FP8 output (scale_result) has no user on CPU here")
    if scale_result is not None:
        raise NotImplementedError("torchtitan_lite's CPU _scaled_mm takes no scale_result (FP8 outputs only)")
    out = (a.double() @ b.double()) * scale_a.double().reshape(-1, 1) * scale_b.double().reshape(1, -1)
    if bias is not None:
        out = out + bias.double()
    return out.to(out_dtype)


def _check_scale(name: str, scale: torch.Tensor, rowwise: tuple[int, int]) -> None:
    if scale.numel() != 1 and tuple(scale.shape) != rowwise:
        raise NotImplementedError(f"torchtitan_lite's CPU _scaled_mm takes {name} with one element or shape "
                                  f"{rowwise}, got {tuple(scale.shape)} (blockwise scales are CUDA-only)")


def _seconds(fn: Callable[..., torch.Tensor], *args: torch.Tensor, **kwargs: object) -> float:
    """The best of ``_REPEATS`` timed calls after a warm-up call (which picks and builds the kernel)."""
    fn(*args, **kwargs)
    best = float("inf")
    for _ in range(_REPEATS):
        start = time.perf_counter()
        fn(*args, **kwargs)
        best = min(best, time.perf_counter() - start)
    return best


def native_gflops() -> float:
    """The rate of this CPU's ``torch._scaled_mm`` at M = N = K = 128 (float8 e4m3 operands, float32 out)."""
    g = torch.Generator().manual_seed(0)
    a = torch.randn(_PROBE, _PROBE, generator=g).to(torch.float8_e4m3fn)
    b = torch.randn(_PROBE, _PROBE, generator=g).to(torch.float8_e4m3fn).t()  # column-major, as the kernel wants
    one = torch.ones(())
    seconds = _seconds(torch._scaled_mm, a, b, scale_a=one, scale_b=one, out_dtype=torch.float32)
    return 2 * _PROBE**3 / max(seconds, 1e-9) / 1e9


@functools.cache
def use_fast_cpu_scaled_mm() -> bool:
    """Register ``scaled_mm_float64`` as the CPU ``aten::_scaled_mm`` when the native kernel is slow; whether it
    did. Once per process (the registration holds for the process)."""
    global _library, _why
    gflops = native_gflops()
    if gflops >= MIN_GFLOPS:
        return False
    _library = torch.library.Library("aten", "IMPL")
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*[Oo]verrid.*")  # replacing the kernel is the point
        _library.impl("_scaled_mm", scaled_mm_float64, "CPU")
    _why = (f"this CPU's torch._scaled_mm runs at {gflops:.2f} GFLOP/s (oneDNN without an FP8 kernel): CPU FP8 "
            f"GEMMs run as float64 matmuls of the same FP8 operands instead, rounded once")
    logger.debug("%s", _why)
    return True
