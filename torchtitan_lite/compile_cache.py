"""Compiled kernels and Triton autotuning results kept across processes, under ``$TORCHTITAN_LITE_CACHE``.

inductor caches compiled graphs under ``$TORCHINDUCTOR_CACHE_DIR`` (default ``/tmp/torchinductor_$USER``) and
Triton its kernels under ``$TRITON_CACHE_DIR`` (default ``~/.triton/cache``); Triton keeps *autotuning*
results only when ``TRITON_CACHE_AUTOTUNING=1``. torchao's FP8 Triton kernels (blockwise quantization,
grouped GEMMs) autotune on first use, ~100 s a shape on an H200, so without that cache every run of a
blockwise or grouped-FP8 config pays it again. A training process points all three at the project's cache
folder unless the user set them, so a second run on the same machine autotunes nothing.
"""
from __future__ import annotations

import os
from pathlib import Path

from torchtitan_lite.components.data.cache import cache_root

AUTOTUNE_SUFFIX = ".autotune.json"
"""What Triton writes per autotuned kernel into its cache when TRITON_CACHE_AUTOTUNING=1."""


def use_project_compile_caches() -> dict[str, str]:
    """Set the cache variables the user left unset (see the module docstring); returns what it set."""
    root = cache_root()
    chosen = {}
    for var, value in (("TORCHINDUCTOR_CACHE_DIR", str(root / "inductor")), ("TRITON_CACHE_DIR", str(root / "triton")),
                       ("TRITON_CACHE_AUTOTUNING", "1")):
        if not os.environ.get(var):
            os.environ[var] = value
            chosen[var] = value
    return chosen


def autotuned_kernels() -> int:
    """Autotuning results in Triton's cache so far (0 without a Triton cache folder)."""
    folder = os.environ.get("TRITON_CACHE_DIR")
    if not folder or not Path(folder).is_dir():
        return 0
    return sum(1 for _ in Path(folder).rglob(f"*{AUTOTUNE_SUFFIX}"))
