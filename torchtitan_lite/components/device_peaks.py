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
(``metrics.cpu_peak_tflops``) or measured once with ``measure_cpu_peak_tflops``: the best rate of
the fastest dense dtype the CPU runs natively (float32, and bfloat16 / float16 where oneDNN has kernels
for them), so that MFU stays below 100% for every precision.
"""
from __future__ import annotations

import re
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


CPU_BF16_FLAGS = ("avx512_bf16", "amx_bf16")
"""/proc/cpuinfo flags of CPUs whose oneDNN bfloat16 matmuls run natively (elsewhere they are emulated,
~50x slower than float32)."""
CPU_FP16_FLAGS = ("avx512_fp16", "amx_fp16")


def cpu_flags() -> set[str]:
    """The CPU feature flags of /proc/cpuinfo (empty where there is none, e.g. macOS)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def cpu_dense_dtypes(flags: set[str] | None = None) -> list[torch.dtype]:
    """Matmul dtypes this CPU runs natively: float32 always, bfloat16 / float16 where oneDNN has kernels
    for them (the CPU flags say so and torch was built with oneDNN)."""
    flags = cpu_flags() if flags is None else flags
    dtypes = [torch.float32]
    if torch.backends.mkldnn.is_available():
        if flags & set(CPU_BF16_FLAGS):
            dtypes.append(torch.bfloat16)
        if flags & set(CPU_FP16_FLAGS):
            dtypes.append(torch.float16)
    return dtypes


def measure_cpu_peak_tflops(dtypes: list[torch.dtype] | None = None) -> tuple[torch.dtype, float]:
    """(dtype, TFLOP/s) of the fastest dense matmul dtype of this CPU: the peak MFU is measured against,
    so no precision can exceed 100%."""
    rates = {dtype: measure_cpu_matmul_tflops(dtype) for dtype in (dtypes or cpu_dense_dtypes())}
    best = max(rates, key=rates.__getitem__)
    return best, rates[best]


def measure_cpu_matmul_tflops(dtype: torch.dtype = torch.float32, *, budget_s: float = 0.5,
                              min_size: int = 512, max_size: int = 4096) -> float:
    """Achieved TFLOP/s of square matmuls on this CPU with the current thread count.

    The rate is the fastest of many timed matmuls: other processes only ever slow a matmul down, so the
    best one is the closest to what the CPU can do. The matrix size (at least ``min_size``) doubles until
    the fastest of three takes a twentieth of the budget, so per-call overhead does not count; then half
    the budget (at least five matmuls) times that size.
    """
    size = min_size
    while True:
        a = torch.randn(size, size).to(dtype)
        b = torch.randn(size, size).to(dtype)
        out = torch.mm(a, b)  # warm-up: the first call allocates and picks kernels
        if _fastest_matmul_s(a, b, out, tries=3) >= budget_s / 20 or size >= max_size:
            break
        size *= 2
    fastest = float("inf")
    count = 0
    start = time.perf_counter()
    while count < 5 or time.perf_counter() - start < budget_s / 2:
        fastest = min(fastest, _fastest_matmul_s(a, b, out, tries=1))
        count += 1
    return 2 * size**3 / fastest / 1e12


def _fastest_matmul_s(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, *, tries: int) -> float:
    fastest = float("inf")
    for _ in range(tries):
        start = time.perf_counter()
        torch.mm(a, b, out=out)
        fastest = min(fastest, time.perf_counter() - start)
    return fastest
