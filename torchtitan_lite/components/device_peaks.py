"""Peak matmul throughput that MFU is measured against.

GPUs: the vendor's dense (no 2:4 sparsity) BF16 tensor-core peak per device, from the datasheets.
MFU is always reported against this BF16 peak, also for FP32 or FP8 runs, so that recipes compare on
one scale (an FP8 run can exceed what BF16 could reach; an FP32 run looks as slow as it is).

    device name contains      dense BF16 TFLOP/s
    H100 / H800 ... PCIe          756
    H100 ... NVL                   835   (H100 NVL, per GPU)
    H100 / H800                    989   (SXM5; reported as "H100 80GB HBM3")
    H200 ... NVL                   835
    H200 / GH200                   989
    GB200                         2500   (per GPU)
    B200                          2250   (HGX B200)
    B100                          1750
    A100 / A800                    312   (SXM4 and PCIe)
    L40S                           362
    L40                            181
    L4                             121
    A10                            125   (not A10G, whose clocks differ)
    MI300X / MI325X               1307

CPUs have no such table: their peak depends on cores, SIMD width and clocks, so it is either given
(``metrics.cpu_peak_tflops``) or measured once with ``measure_cpu_matmul_tflops``.
"""
from __future__ import annotations

import re
import statistics
import time

import torch

# First match wins, so more specific names come first.
GPU_BF16_PEAK_TFLOPS: list[tuple[str, float]] = [
    (r"H[18]00.*PCIE", 756.0),
    (r"H100.*NVL", 835.0),
    (r"H100|H800", 989.0),
    (r"H200.*NVL", 835.0),
    (r"H200", 989.0),
    (r"GB200", 2500.0),
    (r"B200", 2250.0),
    (r"B100", 1750.0),
    (r"A100|A800", 312.0),
    (r"L40S", 362.0),
    (r"\bL40\b", 181.0),
    (r"\bL4\b", 121.0),
    (r"\bA10\b", 125.0),
    (r"MI300X|MI325X", 1307.0),
]


def gpu_bf16_peak_flops(device_name: str) -> float | None:
    """Dense BF16 peak in FLOP/s for a GPU name as ``torch.cuda.get_device_name`` reports it."""
    upper = device_name.upper()
    for pattern, tflops in GPU_BF16_PEAK_TFLOPS:
        if re.search(pattern, upper):
            return tflops * 1e12
    return None


def device_peak_flops(device: torch.device | str) -> float | None:
    """Dense BF16 peak in FLOP/s of a CUDA device from the table; None for CPUs and unknown GPUs."""
    device = torch.device(device)
    if device.type != "cuda":
        return None
    return gpu_bf16_peak_flops(torch.cuda.get_device_name(device))


def measure_cpu_matmul_tflops(dtype: torch.dtype = torch.bfloat16, *, budget_s: float = 0.5) -> float:
    """Achieved TFLOP/s of square matmuls on this CPU with the current thread count.

    The matrix size doubles until one matmul takes about a twentieth of the budget, so per-call
    overhead does not dominate (the fastest of three tries decides, as other processes may steal
    the CPU for a moment); half the budget then times back-to-back matmuls of that size, and the
    median one gives the rate.
    """
    size = 128
    while True:
        a = torch.randn(size, size).to(dtype)
        b = torch.randn(size, size).to(dtype)
        out = torch.mm(a, b)  # warm-up: the first call allocates and picks kernels
        if _fastest_matmul_s(a, b, out, tries=3) >= budget_s / 20 or size >= 4096:
            break
        size *= 2
    durations: list[float] = []
    start = time.perf_counter()
    while not durations or time.perf_counter() - start < budget_s / 2:
        durations.append(_fastest_matmul_s(a, b, out, tries=1))
    return 2 * size**3 / statistics.median(durations) / 1e12


def _fastest_matmul_s(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, *, tries: int) -> float:
    fastest = float("inf")
    for _ in range(tries):
        start = time.perf_counter()
        torch.mm(a, b, out=out)
        fastest = min(fastest, time.perf_counter() - start)
    return fastest
