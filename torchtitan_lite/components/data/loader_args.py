"""What every data loader is built from: the data settings it reads, and the build arguments it checks."""
from __future__ import annotations

from typing import Protocol

from torchtitan_lite.components.data.sources import SourceConfig
from torchtitan_lite.components.data.windows import ShuffleMode


class LoaderConfig(SourceConfig, Protocol):
    """The ``data`` settings a loader reads (``TextDataLoader.Config`` holds them)."""

    token_store: str | None
    shuffle: ShuffleMode
    shuffle_buffer: int


def check_build_args(dp_rank: int, dp_world_size: int, seq_len: int, local_batch_size: int, split: str) -> None:
    if dp_world_size < 1 or not 0 <= dp_rank < dp_world_size:
        raise ValueError(f"dp_rank={dp_rank} is not a rank of dp_world_size={dp_world_size}")
    if seq_len < 1 or local_batch_size < 1:
        raise ValueError(f"seq_len={seq_len} and local_batch_size={local_batch_size} must be positive")
    if split not in ("train", "validation"):
        raise ValueError(f"split={split!r} must be 'train' or 'validation'")
