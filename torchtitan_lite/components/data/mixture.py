"""The order of a weighted mixture: which source, and which of its positions, each global position reads.

Global positions are grouped in blocks of ``K``. Block ``b`` gives source ``i`` the difference of its
cumulative targets ``T_i(b + 1) - T_i(b)``, where ``T_i(n)`` is the largest-remainder share of ``n K`` slots
by the normalised weights ``w_i`` (exact fractions, ties to the lower index): the carry of remainders lives
in the cumulative targets, so after ``n`` blocks every source has read ``n K w_i`` windows within less than
one, however long the run. Inside a block the slots are ordered by a permutation drawn from ``(seed, b)``,
so a batch mixes the sources rather than reading them in runs. ``K`` is at least ``1 / min(w)``, which
keeps every block's count non-negative (and gives every source a slot in every block).

A source reads its own positions ``0, 1, 2, ...`` in order, in its own window order (``windows.py``, its
own seed and epochs). Global position ``p`` maps to ``(source, q)`` from ``p`` alone, in constant time per
block, so the mixture resumes on any layout exactly as one source does: its state is the number of
positions read.
"""
from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence
from fractions import Fraction

import numpy as np

MIN_BLOCK = 64
"""Positions per block at least; more when a weight is below 1/64 of the total."""
_INTERLEAVE_STREAM = 0x6D6978
"""Keeps the block permutations' random stream apart from the window permutations' ``(seed, epoch)``."""


def source_seed(seed: int, name: str) -> int:
    """The seed of source ``name``'s window order: two sources never share a permutation, and a source's
    order does not change when others are added or reordered."""
    return int.from_bytes(hashlib.sha256(f"{seed}/{name}".encode()).digest()[:8], "little")


class MixtureOrder:
    """Position -> (source index, that source's position), for ``weights`` (positive, any scale)."""

    def __init__(self, weights: Sequence[float], seed: int) -> None:
        if not weights or any(not (w > 0 and math.isfinite(w)) for w in weights):
            raise ValueError(f"mixture weights must be positive and finite, got {list(weights)}")
        total = sum(Fraction(w) for w in weights)
        self.shares = [Fraction(w) / total for w in weights]
        self.seed = seed
        self.block = max(MIN_BLOCK, math.ceil(1 / min(self.shares)))
        self._blocks: dict[int, tuple[np.ndarray, np.ndarray]] = {}

    def cumulative(self, n: int) -> np.ndarray:
        """int64 [sources]: windows of each source among the first ``n`` full blocks, ``T_i(n)``."""
        slots = n * self.block
        exact = [slots * w for w in self.shares]
        counts = [math.floor(x) for x in exact]
        left = slots - sum(counts)
        # Largest remainders first, ties to the lower index: exact, so the same on every machine.
        for i in sorted(range(len(exact)), key=lambda i: (-(exact[i] - counts[i]), i))[:left]:
            counts[i] += 1
        return np.asarray(counts, dtype=np.int64)

    def counts(self, n: int) -> np.ndarray:
        """int64 [sources]: windows of each source among global positions ``[0, n)``."""
        b, inside = divmod(n, self.block)
        counts = self.cumulative(b)
        sources, _ = self._block(b)
        return counts + np.bincount(sources[:inside], minlength=len(self.shares))

    def locate(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(source index, that source's position) of each global position."""
        blocks, inside = np.divmod(np.asarray(positions, dtype=np.int64), self.block)
        sources, local = np.empty_like(inside), np.empty_like(inside)
        for b in np.unique(blocks):
            here = blocks == b
            block_sources, block_local = self._block(int(b))
            sources[here] = block_sources[inside[here]]
            local[here] = block_local[inside[here]]
        return sources, local

    def _block(self, b: int) -> tuple[np.ndarray, np.ndarray]:
        """Block ``b``'s slots: the source of each, and the position of that source it reads."""
        if b not in self._blocks:
            before, after = self.cumulative(b), self.cumulative(b + 1)
            slots = np.repeat(np.arange(len(self.shares)), after - before)
            order = np.random.Generator(np.random.PCG64([_INTERLEAVE_STREAM, self.seed, b])).permutation(slots)
            local = np.empty(self.block, dtype=np.int64)
            for i in range(len(self.shares)):
                mine = order == i
                local[mine] = before[i] + np.arange(int(mine.sum()))
            while len(self._blocks) >= 8:  # a global batch spans a few blocks at most; the oldest go first
                del self._blocks[next(iter(self._blocks))]
            self._blocks[b] = (order, local)
        return self._blocks[b]
