"""Where each data-parallel rank stands in an epoch, in terms that do not depend on the layout.

An epoch of a map-style split is one global order of its ``n`` rows (a permutation seeded by
``(seed, epoch)``, or the file order): order position ``p`` names row ``order[p]`` on every rank
and under every data-parallel degree. A rank reads its own *sequence* of positions: first an explicit
``pending`` list (empty except right after a reshard), then the arithmetic progression
``stride_start, stride_start + stride, ...`` below ``n``. At the start of an epoch rank ``r`` of ``D``
reads ``[]`` then ``r, r + D, r + 2D, ...``: the ranks' sequences partition the epoch.

``read`` items of the sequence are tokenised; ``char`` characters of the next one as well (a large
document streamed in chunks). The tokens read but not yet batched are the rank's ``buffer``.

Resharding (``reshard``) turns the positions of every old rank into those of the new ranks so that the
new sequences partition exactly what the old ones had not read yet:

- ``M`` is the furthest progression point of any old rank. Everything the old ranks had left below
  ``M`` (their pending items, progression items below ``M``, a document read up to ``char``) becomes
  explicit pending items of the new ranks; new rank ``r`` of ``D'`` continues with ``M + r, M + r + D',
  ...``. Each old rank's buffer, and the rest of the document it was reading, go to new rank
  ``old_rank mod D'`` (that document stays contiguous); the other leftover documents are dealt out
  round-robin in position order.
- So no document of the epoch is read twice or skipped, and every token read but not trained on is
  carried over. The one exception: when the old ranks stand in different epochs (a checkpoint taken
  while some ranks had already wrapped around), the resharded run continues in the newest epoch and
  the documents the lagging ranks had left in the older epoch are not read in that epoch.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from torchtitan_lite.components.data.packing import TOKEN_DTYPE, empty_buffer


@dataclass
class RankPosition:
    dp_rank: int
    dp_world_size: int
    epoch: int = 0
    pending: list[tuple[int, int]] = field(default_factory=list)
    """(order position, first character) read before the progression; the character is 0 except for a
    document another rank had partly read."""
    stride_start: int = -1
    """First progression position; -1 means the epoch's default, this rank's dp_rank."""
    stride: int = 0
    """Progression step; 0 means the epoch's default, dp_world_size."""
    read: int = 0
    char: int = 0
    buffer: np.ndarray = field(default_factory=empty_buffer)

    def __post_init__(self) -> None:
        if self.stride_start < 0:
            self.stride_start = self.dp_rank
        if self.stride <= 0:
            self.stride = self.dp_world_size

    @property
    def at_epoch_start(self) -> bool:
        """Nothing of this epoch read, and the sequence is the layout's default one."""
        return (self.read == 0 and self.char == 0 and not self.pending
                and (self.stride_start, self.stride) == (self.dp_rank, self.dp_world_size))

    def length(self, n: int) -> int:
        """Items of the sequence in an epoch of ``n`` positions."""
        tail = 0 if self.stride_start >= n else -(-(n - self.stride_start) // self.stride)
        return len(self.pending) + tail

    def item(self, i: int) -> tuple[int, int]:
        """(order position, first character) of sequence item ``i`` (which must exist)."""
        if i < len(self.pending):
            return self.pending[i]
        return self.stride_start + (i - len(self.pending)) * self.stride, 0

    def next_epoch(self) -> None:
        self.epoch += 1
        self.pending, self.stride_start, self.stride = [], self.dp_rank, self.dp_world_size
        self.read, self.char = 0, 0


def reshard(old: list[RankPosition], dp_rank: int, dp_world_size: int, n: int) -> RankPosition:
    """The position of rank ``dp_rank`` of ``dp_world_size`` that continues where the ``old`` ranks (one
    per old data-parallel rank, any order) stood in an epoch of ``n`` positions. See the module docstring."""
    old = sorted(old, key=lambda p: p.dp_rank)
    _check_complete(old)
    epoch = max(p.epoch for p in old)
    # A rank still in an older epoch has read nothing of the newest one: its default sequence.
    current = [p if p.epoch == epoch else RankPosition(p.dp_rank, p.dp_world_size, epoch) for p in old]
    frontier = max(_progression_next(p) for p in current)
    owned: list[list[tuple[int, int]]] = [[] for _ in range(dp_world_size)]
    loose: list[tuple[int, int]] = []
    for p in current:
        items = [p.item(i) for i in range(p.read, p.length(min(n, frontier)))]
        if items and p.char:
            owned[p.dp_rank % dp_world_size].append((items[0][0], p.char))
            items = items[1:]
        loose.extend(items)
    loose.sort()
    mine = owned[dp_rank] + loose[dp_rank::dp_world_size]
    buffers = [p.buffer for p in old if p.dp_rank % dp_world_size == dp_rank]
    buffer = np.concatenate(buffers).astype(TOKEN_DTYPE) if buffers else empty_buffer()
    return RankPosition(dp_rank, dp_world_size, epoch, mine, frontier + dp_rank, dp_world_size, 0, 0, buffer)


def read_positions(p: RankPosition, n: int) -> tuple[set[int], set[int]]:
    """Order positions of ``p``'s epoch that it has read: (wholly, partly) -- the view of one rank."""
    wholly = {p.item(i)[0] for i in range(min(p.read, p.length(n)))}
    partly = {p.item(p.read)[0]} if p.char and p.read < p.length(n) else set()
    return wholly, partly


def _progression_next(p: RankPosition) -> int:
    """The first progression position ``p`` has not started to read (a partly read one lies below it, so
    that it is carried over with its character)."""
    started = p.read + (1 if p.char else 0)
    return p.stride_start + max(0, started - len(p.pending)) * p.stride


def _check_complete(old: list[RankPosition]) -> None:
    worlds = {p.dp_world_size for p in old}
    ranks = [p.dp_rank for p in old]
    if len(worlds) != 1 or ranks != list(range(worlds.pop())):
        raise ValueError(f"resharding a data position needs the state of every old data-parallel rank; got ranks "
                         f"{ranks} of data-parallel sizes {sorted({p.dp_world_size for p in old})}")
