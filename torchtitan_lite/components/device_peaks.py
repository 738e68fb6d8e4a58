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
(``metrics.cpu_peak_tflops``) or measured with ``measure_cpu_peak_tflops``: the best rate of the
fastest dense dtype the CPU runs natively (float32, and bfloat16 / float16 where oneDNN has kernels for
them), so that MFU stays below 100% for every precision. The measurement takes seconds and, on a shared
host, varies with what else runs, so it is made once per machine and kept in
``$TORCHTITAN_LITE_CACHE/cpu_peak.json`` under a key of CPU model, CPU flags, torch version and core
count (``cached_cpu_peak``). It is the machine's peak: measured with one thread per core this process may
run on, whatever thread count the run itself uses, so every run on the same machine reports MFU on the
same scale (a run on fewer threads shows a lower MFU, not the same one against a lower peak). The
processes of one node share that peak (``process_share_flops``): each rank's MFU is its FLOP/s against its
share, i.e. the node's FLOP/s against the machine's peak.
"""
from __future__ import annotations

import hashlib
import json
import os
import platform
import re
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from torchtitan_lite.components.data.cache import cache_root, file_lock

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


def machine_cores() -> int:
    """The cores this process may run on (its CPU affinity: a container or ``taskset`` may allow fewer than
    the machine has)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def measure_cpu_peak_tflops(dtypes: list[torch.dtype] | None = None) -> tuple[torch.dtype, float]:
    """(dtype, TFLOP/s) of the fastest dense matmul dtype of this CPU on all its cores: the peak MFU is
    measured against, so no precision can exceed 100% and no thread count changes the scale."""
    threads = torch.get_num_threads()
    torch.set_num_threads(machine_cores())
    try:
        rates = {dtype: measure_cpu_matmul_tflops(dtype) for dtype in (dtypes or cpu_dense_dtypes())}
    finally:
        torch.set_num_threads(threads)  # the run keeps the thread count it was started with
    best = max(rates, key=rates.__getitem__)
    return best, rates[best]


def process_share_flops(machine_peak_flops: float, processes_on_node: int) -> float:
    """The part of a machine's peak one of ``processes_on_node`` CPU processes is measured against: they share
    its cores, so the node's MFU is what they achieve together against the whole machine."""
    return machine_peak_flops / max(1, processes_on_node)


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


PEAK_CACHE_FILE = "cpu_peak.json"


@dataclass(frozen=True)
class CpuPeak:
    """A CPU peak for MFU and where it came from."""

    dtype: str
    """The matmul dtype that reached it ('float32', 'bfloat16', ...)."""
    tflops: float
    measured_now: bool
    """Measured by this call; False: read from the cache."""
    path: Path
    """The cache file that holds it."""


def cpu_model_name() -> str:
    """The CPU model as /proc/cpuinfo names it (``platform.processor()`` where there is none)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown cpu"


def cpu_peak_key(*, model: str | None = None, flags: set[str] | None = None, torch_version: str | None = None,
                 cores: int | None = None) -> str:
    """What the machine's peak depends on: CPU model, CPU flags (hashed: hundreds of them), torch version (its
    oneDNN kernels) and the cores it is measured on. Each defaults to this process's value; the run's own
    thread count is not part of it."""
    model = cpu_model_name() if model is None else model
    flags = cpu_flags() if flags is None else flags
    flags_hash = hashlib.sha256(" ".join(sorted(flags)).encode()).hexdigest()[:12]
    version = torch.__version__ if torch_version is None else torch_version
    cores = machine_cores() if cores is None else cores
    return f"{model} | flags {flags_hash} | torch {version} | {cores} cores"


def cached_cpu_peak(*, remeasure: bool = False) -> CpuPeak:
    """This machine's CPU peak: read from the cache, or measured (``measure_cpu_peak_tflops``) and saved
    there when the cache has none for this key or ``remeasure`` asks for a fresh one. The measurement is
    made under the cache's lock: the processes of one node starting together would otherwise measure at
    once, each on cores the others are busy with."""
    path = cache_root() / PEAK_CACHE_FILE
    key = cpu_peak_key()
    if not remeasure:
        entry = _read_peaks(path).get(key)
        if entry is not None:
            return CpuPeak(entry["dtype"], float(entry["tflops"]), measured_now=False, path=path)
    try:
        with file_lock(path.parent / f".{path.name}.lock"):
            entry = None if remeasure else _read_peaks(path).get(key)
            if entry is not None:  # another process of this node measured it while this one waited
                return CpuPeak(entry["dtype"], float(entry["tflops"]), measured_now=False, path=path)
            return _measure_and_store(path, key)
    except OSError:  # no writable cache: measure anyway, the next run measures again
        return _measure_and_store(path, key)


def _measure_and_store(path: Path, key: str) -> CpuPeak:
    dtype, tflops = measure_cpu_peak_tflops()
    name = str(dtype).removeprefix("torch.")
    _write_peak(path, key, {"dtype": name, "tflops": tflops, "measured": time.strftime("%Y-%m-%d %H:%M:%S")})
    return CpuPeak(name, tflops, measured_now=True, path=path)


def raise_cached_cpu_peak(tflops: float, *, dtype: str = "achieved") -> None:
    """A run achieved ``tflops`` on the whole machine, more than the cached peak (measured while the host was
    busy): keep the higher figure for this machine's later runs."""
    path = cache_root() / PEAK_CACHE_FILE
    key = cpu_peak_key()
    if tflops > float(_read_peaks(path).get(key, {}).get("tflops", 0.0)):
        _store_peak(path, key, {"dtype": dtype, "tflops": tflops, "measured": time.strftime("%Y-%m-%d %H:%M:%S")})


def _read_peaks(path: Path) -> dict[str, dict]:
    """The cache's entries; an unreadable or damaged file is an empty cache (the peak is measured again)."""
    try:
        peaks = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(peaks, dict):
        return {}
    return {k: v for k, v in peaks.items() if isinstance(v, dict) and isinstance(v.get("tflops"), (int, float))}


def _store_peak(path: Path, key: str, entry: dict) -> None:
    """Add ``entry`` under ``key`` (other machines' entries stay), atomically; a read-only cache only costs
    a measurement next time."""
    try:
        with file_lock(path.parent / f".{path.name}.lock"):
            _write_peak(path, key, entry)
    except OSError:
        pass


def _write_peak(path: Path, key: str, entry: dict) -> None:
    """``_store_peak`` for a caller that holds the lock."""
    try:
        peaks = _read_peaks(path)
        peaks[key] = entry
        scratch = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        scratch.write_text(json.dumps(peaks, indent=1, sort_keys=True) + "\n")
        os.replace(scratch, path)
    except OSError:
        pass
