"""What context parallelism needs of a model's layers: each layer that reads the whole sequence (attention's keys
and values, a per-sequence MoE balance statistic) learns the group of ranks that share the sequence.

The models side implements it (models/common/attention/grouped_query.py, models/deepseek_v3/attention.py,
models/common/moe/layer.py); the core (torchtitan_lite/distributed/context_parallel.py) finds the layers by this
shape, so the parallelize sequence never imports a model family.
"""
from __future__ import annotations

from typing import Protocol, runtime_checkable

from torch.distributed import ProcessGroup


@runtime_checkable
class ContextParallelLayer(Protocol):
    """A layer whose forward needs what other ranks of its CP group hold of the same sequences."""

    def use_context_parallel(self, group: ProcessGroup) -> bool:
        """From now on exchange over ``group`` (the rank's CP group; each rank holds its chunks of every
        sequence). Returns True for an attention layer (the part that makes a block context-parallel)."""
        ...
