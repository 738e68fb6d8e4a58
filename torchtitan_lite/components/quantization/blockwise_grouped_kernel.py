"""Whether blockwise FP8 routed experts can run torchao 0.18's grouped blockwise GEMM, and what is missing if not.

torch has no grouped blockwise FP8 GEMM. torchao 0.18's ``_to_fp8_blockwise_then_scaled_grouped_mm``
(``prototype/moe_training/blockwise_fp8``) quantizes with its Triton kernels and, with ``KernelPreference.AUTO``,
multiplies on DeepGEMM when torchao's own ``can_use_deepgemm_grouped_training`` holds: the ``deep_gemm`` package
imports and exposes both its M-grouped and K-grouped FP8 GEMMs, the input is on a CUDA GPU of compute
capability 9.0+, the output is bfloat16 and the block 128. Otherwise torchao falls back to its emulated backend
(bfloat16 dequantization, ``torch._grouped_mm``), which this converter does not use: its own emulation
(grouped_gemm.py) multiplies the same tiles in float32 instead. So ``auto`` calls torchao's op only where
DeepGEMM runs, and emulates everywhere else with the reason.

torchao's scales are float32 ``448 / amax`` (never rounded to powers of 2), so ``power_of_2_scales=true``
always emulates. The probe of ``deep_gemm`` runs only on a CUDA GPU of compute capability 9.0+: CPU runs never
import it (nor torchao's Triton kernels).
"""
from __future__ import annotations

import importlib.util

import torch

NEED = (9, 0)
"""DeepGEMM's FP8 grouped GEMMs need Hopper (torchao's ``_is_cuda_sm90_or_newer``)."""
NEED_TEXT = "an NVIDIA GPU of compute capability 9.0+ (Hopper)"
INSTALL = ("install DeepGEMM (https://github.com/deepseek-ai/DeepGEMM) built against this torch and CUDA: it "
           "compiles CUDA code (nvcc), and PyPI's deep_gemm 1.0.0 sdist ships no CUDA headers")
KERNEL_TEXT = "torchao's grouped blockwise FP8 GEMM (DeepGEMM)"


def deep_gemm_missing() -> str:
    """'' when torchao would run DeepGEMM in this process; else what is missing. Imports ``deep_gemm`` (through
    torchao's cached capability check) only when a package of that name is installed."""
    from torch.utils._triton import has_triton

    if importlib.util.find_spec("deep_gemm") is None:
        return "the deep_gemm package is not installed"
    if not has_triton():
        return "triton is not installed (torchao's blockwise quantizers are Triton kernels)"
    from torchao.prototype.blockwise_fp8_training.deepgemm_grouped_kernels import _get_deepgemm_capabilities

    found = _get_deepgemm_capabilities()
    if found.import_error is not None:
        return f"the deep_gemm package does not import ({found.import_error})"
    absent = [name for name, kernel in (("m_grouped_fp8_gemm_nt_contiguous", found.m_grouped_gemm),
                                        ("k_grouped_fp8_gemm_nt_contiguous", found.k_grouped_gemm)) if kernel is None]
    return f"the installed deep_gemm lacks {' and '.join(absent)}" if absent else ""


def blockwise_kernel_missing(device_type: str, capability: tuple[int, int] | None, device_name: str,
                             deep_gemm: str, power_of_2: bool, compute_dtype: torch.dtype) -> list[str]:
    """Why torchao's grouped blockwise GEMM cannot run (empty: it can). ``deep_gemm``: ``deep_gemm_missing()``'s
    answer (consulted on a GPU of compute capability 9.0+ only); ``capability`` None on a GPU: unknown yet."""
    missing = []
    if device_type != "cuda":
        missing.append(f"{device_type} has no blockwise grouped GEMM kernel (it needs {NEED_TEXT} and deep_gemm)")
    elif capability is not None and capability < NEED:
        missing.append(f"{device_name} (compute capability {capability[0]}.{capability[1]}) lacks it (it needs "
                       f"{NEED_TEXT})")
    elif capability is not None and deep_gemm:
        missing.append(f"{deep_gemm} (torchao runs its blockwise grouped GEMMs on DeepGEMM)")
    if power_of_2:
        missing.append("power_of_2_scales=true: torchao's blockwise kernels compute float32 scales 448 / amax, never "
                       "powers of 2")
    if compute_dtype != torch.bfloat16:
        missing.append(f"the compute dtype is {str(compute_dtype).removeprefix('torch.')} and the kernel writes "
                       f"bfloat16 only")
    return missing


def blockwise_fix(missing: list[str]) -> str:
    """What to change so that ``native`` runs, for the reasons in ``missing``."""
    fixes = []
    text = " ".join(missing)
    if "has no blockwise" in text or "lacks it" in text:
        fixes.append(f"run on {NEED_TEXT}")
    if "deep_gemm" in text.replace("and deep_gemm)", ""):
        fixes.append(INSTALL)
    if "power_of_2_scales" in text:
        fixes.append("set power_of_2_scales=false")
    if "compute dtype" in text:
        fixes.append("use precision.param_dtype=bfloat16")
    return "; ".join(fixes)
