"""Sums over the tokens of one training step, which the batch group's ranks hold between them.

The batch group is every rank that holds different tokens of a step: the data-parallel ranks, and under context
parallelism the CP ranks that each hold their chunks of the same sequences (``ParallelDims.batch_mesh``). The
loss is normalised by the step's target tokens counted over it, and the logged loss summed over it.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from torchtitan_lite.components.loss import IGNORE_INDEX


def sum_over(value: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """``value`` summed over ``group`` in place (unchanged without one)."""
    if group is not None:
        dist.all_reduce(value, group=group)
    return value


def global_target_tokens(labels: Sequence[torch.Tensor], device: torch.device,
                         group: dist.ProcessGroup | None) -> torch.Tensor:
    """The step's target tokens (labels not ignored) over ``group``, as a float32 device scalar (at least 1).
    ``labels``: this rank's, after its sequence layout (under CP its chunks only)."""
    # Counted where the labels are (the host) and sent to the device without reading anything back.
    local = torch.stack([(batch != IGNORE_INDEX).sum() for batch in labels]).sum()
    return sum_over(local.to(device, torch.float32, non_blocking=True), group).clamp_min(1.0)
