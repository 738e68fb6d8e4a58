"""CPU kernels from ``torch.compile`` at a vector width this machine's C++ compiler gets right.

On a CPU with AVX-512, inductor transposes bfloat16 tiles with ``at::vec::transpose_mxn<BFloat16, 32, 32>``.
Found on an Intel Xeon with AMX (torch 2.13, gcc 12.2): a generated kernel holding *two* such transposes
returns wrong values from both (one alone is right), non-finite ones among them. Compiled Qwen3-MoE blocks
hit it, since the kernel that casts the three expert weights to bfloat16 and lays them out for the grouped
GEMMs transposes all three at once: the expert gradients of the first step were NaN. An AMD EPYC with AVX2
never runs that code (its vectors are 256 bits wide).

``use_correct_cpu_vector_width`` compiles that pattern once per process, a two-transpose kernel on known data,
and where the result is wrong caps inductor's CPU vector width at 256 bits
(``torch._inductor.config.cpp.simdlen``), which selects the AVX2 kernels: correct, somewhat slower. The probe
is skipped where the vectors are narrower than 512 bits or the user chose a width; CUDA kernels are untouched.
"""
from __future__ import annotations

import functools
import logging
import subprocess

import torch

logger = logging.getLogger(__name__)

SAFE_SIMDLEN = 256
"""Bits per CPU vector where the AVX-512 transpose is miscompiled."""
_TILE = 32
_SIDE = 64
"""The probe transposes two 64x64 bfloat16 matrices in 32x32 tiles (the tile inductor uses at 512 bits)."""


def _transpose(src: str, dst: str) -> str:
    return f"""
    for (int64_t r = 0; r < {_SIDE}; r += {_TILE})
        for (int64_t c = 0; c < {_SIDE}; c += {_TILE}) {{
            alignas(64) at::BFloat16 tile[{_TILE * _TILE}];
            at::vec::transpose_mxn<at::BFloat16, {_TILE}, {_TILE}>({src} + c + {_SIDE}L * r, {_SIDE}L, tile, {_TILE}L);
            for (int64_t i = 0; i < {_TILE}; i++)
                at::vec::Vectorized<at::BFloat16>::loadu(tile + {_TILE}L * i, {_TILE})
                    .store({dst} + r + {_SIDE}L * (c + i), {_TILE});
        }}"""


PROBE_SOURCE = ("#include <torch/csrc/inductor/cpp_prefix.h>\n"
                "extern \"C\" void kernel(const at::BFloat16* a, const at::BFloat16* b, at::BFloat16* a_t, "
                "at::BFloat16* b_t) {" + _transpose("a", "a_t") + _transpose("b", "b_t") + "\n}\n")
"""The pattern inductor generates for two bfloat16 transposes fused into one kernel, reduced to the transposes."""


def probe_transposes_are_right() -> bool:
    """Compile ``PROBE_SOURCE`` with inductor's flags for this CPU and check both transposes on known data."""
    from torch._inductor.codecache import CppPythonBindingsCodeCache

    kernel = CppPythonBindingsCodeCache.load_pybinding(["const at::BFloat16*"] * 2 + ["at::BFloat16*"] * 2,
                                                       PROBE_SOURCE)
    # Integers up to 256 are exact in bfloat16, so every wrong element shows as a mismatch.
    a = (torch.arange(_SIDE * _SIDE) % 251).to(torch.bfloat16).reshape(_SIDE, _SIDE)
    b = -a.flip(0).contiguous()
    a_t, b_t = torch.zeros_like(a), torch.zeros_like(b)
    kernel(a, b, a_t, b_t)
    return torch.equal(a_t, a.t()) and torch.equal(b_t, b.t())


def _compiler() -> str:
    from torch._inductor.cpp_builder import get_cpp_compiler

    try:
        cxx = get_cpp_compiler()
        version = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=30).stdout
        return version.splitlines()[0] if version else cxx
    except (OSError, RuntimeError, subprocess.SubprocessError):
        return "the C++ compiler"


@functools.cache
def use_correct_cpu_vector_width() -> str | None:
    """Probe once per process (see the module docstring); returns what was changed and why, or None."""
    import torch._inductor.config as inductor_config
    from torch._inductor.cpu_vec_isa import pick_vec_isa

    if inductor_config.cpp.simdlen is not None:
        return None  # the user chose the width
    isa = pick_vec_isa()
    if not isa or isa.bit_width() < 512 or probe_transposes_are_right():
        return None
    inductor_config.cpp.simdlen = SAFE_SIMDLEN
    return (f"CPU kernels compile at {SAFE_SIMDLEN}-bit vectors (torch._inductor.config.cpp.simdlen="
            f"{SAFE_SIMDLEN}) instead of {isa.bit_width()}: {_compiler()} miscompiles inductor's {isa.bit_width()}-bit "
            f"bfloat16 tile transpose when a kernel holds two of them (probed: wrong values), which made compiled "
            f"bfloat16 gradients NaN; the {SAFE_SIMDLEN}-bit kernels compute the same results, somewhat slower")
