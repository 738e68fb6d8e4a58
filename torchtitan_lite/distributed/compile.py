"""torch.compile per transformer block (after activation checkpointing, before FSDP) and of the loss.

Compiling blocks one by one keeps graphs small and identical across blocks (one compile, reused), and
leaves FSDP's per-block hooks and collectives outside the graphs. Compilation is lazy: the cost lands in
the first forward/backward, which `compile_seconds()` reports.
"""
from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from torchtitan_lite.config.sections import CompileConfig
from torchtitan_lite.protocols.model import BaseModel

logger = logging.getLogger(__name__)


def apply_compile(model: BaseModel, compile_config: CompileConfig) -> int:
    """Compile every block of `model.layers` in place (`Module.compile`, so parameter names are unchanged).

    Returns the number of compiled blocks. A no-op unless compile is enabled with 'model' in components.
    """
    if not (compile_config.enable and "model" in compile_config.components):
        return 0
    for block in model.layers.values():
        block.compile(backend=compile_config.backend, fullgraph=compile_config.fullgraph)
    logger.info("compiling %d blocks with backend=%s fullgraph=%s (first step pays the compile time)",
                len(model.layers), compile_config.backend, compile_config.fullgraph)
    return len(model.layers)


def maybe_compile_loss(loss_fn: Callable, *, enabled: bool, backend: str) -> Callable:
    """`loss_fn` compiled with `backend` when `enabled`, else unchanged."""
    if not enabled:
        return loss_fn
    return torch.compile(loss_fn, backend=backend)


def compile_seconds() -> float:
    """Seconds this process has spent compiling so far (dynamo + backend, forward and backward graphs)."""
    from torch._dynamo.utils import calculate_time_spent

    return float(calculate_time_spent().get("total_wall_time", 0.0))
