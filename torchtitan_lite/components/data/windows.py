"""The windows of a token store and the global order in which they are read.

An epoch's token stream is cut into consecutive, non-overlapping windows of ``seq_len + 1`` tokens; the tail
that does not fill a window is dropped (every epoch). A window gives ``inputs = w[:-1]`` and ``labels =
w[1:]``. Windows are numbered ``0 .. W-1`` in stream order, ``W = n_tokens // (seq_len + 1)``.

The *position* of a read is how many windows were read before it, over all ranks and epochs: position
``p`` lies in epoch ``p // W`` at order index ``p % W``. ``data.shuffle`` decides the window there:

- ``windows``: the stream is the store's (source order); the epoch reads window ``perm_e[p % W]``, where
  ``perm_e`` is a permutation of ``W`` drawn by PCG64 from ``(seed, epoch)``: a batch mixes windows from
  all over the data, and every epoch reads each window once in a new order.
- ``documents``: each epoch lays the documents end to end in a permutation drawn from ``(seed, epoch)``
  and cuts that stream; windows are read in order (consecutive windows continue the same documents).
- ``none``: the store's stream, windows in order (validation reads this way).

Which rank reads which position is ``rank_positions``. A mixture of sources (``mixture.py``) keeps one
``WindowIndex`` per source and maps a global position to ``(source, that source's position)``.
"""
from __future__ import annotations

from functools import cached_property
from typing import TYPE_CHECKING, Literal

import numpy as np

if TYPE_CHECKING:
    from torchtitan_lite.components.data.token_store import TokenStore

ShuffleMode = Literal["windows", "documents", "none"]
SHUFFLE_MODES: tuple[ShuffleMode, ...] = ("windows", "documents", "none")


def epoch_permutation(n: int, seed: int, epoch: int) -> np.ndarray:
    """A permutation of ``range(n)``, the same for the same ``(n, seed, epoch)`` on every machine."""
    return np.random.Generator(np.random.PCG64([seed, epoch])).permutation(n)


def rank_positions(first: int, local_batch_size: int, dp_rank: int, dp_world_size: int) -> np.ndarray:
    """The positions of one local batch: the ``local_batch_size x dp_world_size`` positions from ``first`` on
    form one global micro-batch, and rank ``r`` of ``D`` takes ``first + r, first + r + D, ...``.

    So step ``s`` of ``M`` micro-batches reads positions ``[s G, (s + 1) G)``, ``G = B x D x M``; its
    micro-batch ``m`` the ``m``-th run of ``B x D`` of those; row ``b`` of rank ``r`` position
    ``s G + m B D + b D + r``. A position depends on nothing but the count read before it, so a resume on
    another data-parallel degree, micro-batching or global batch reads on exactly where the run stopped."""
    return first + dp_rank + dp_world_size * np.arange(local_batch_size, dtype=np.int64)


class WindowIndex:
    """Window ``k`` of epoch ``e`` of a store: its tokens and where its documents start."""

    def __init__(self, store: TokenStore, seq_len: int, shuffle: ShuffleMode, seed: int | None) -> None:
        self.store, self.seq_len, self.shuffle, self.seed = store, seq_len, shuffle, seed
        self.window = seq_len + 1
        self.n_windows = store.n_tokens // self.window
        self._epochs: dict[int, tuple[np.ndarray, np.ndarray]] = {}

    def locate(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(epoch, window id) of each global position."""
        epochs, index = np.divmod(positions, self.n_windows)
        if self.shuffle != "windows":
            return epochs, index
        windows = np.empty_like(index)
        for epoch in np.unique(epochs):
            here = epochs == epoch
            windows[here] = self._order(int(epoch))[0][index[here]]
        return epochs, windows

    def read(self, epoch: int, window: int) -> tuple[np.ndarray, np.ndarray]:
        """(tokens [seq_len + 1], positions < seq_len where a document starts) of one window."""
        start = window * self.window
        stop = start + self.window
        if self.shuffle != "documents":
            starts = self.store.doc_starts
            first, last = np.searchsorted(starts, [start, start + self.seq_len])
            return self.store.tokens(start, stop), starts[first:last] - start
        perm, permuted_starts = self._order(epoch)
        lengths = self._lengths
        i = int(np.searchsorted(permuted_starts, start, side="right")) - 1
        pieces = []
        while i < len(perm) and permuted_starts[i] < stop:
            doc, at = int(perm[i]), int(permuted_starts[i])
            begin = int(self.store.doc_starts[doc])
            pieces.append(self.store.tokens(begin + max(0, start - at), begin + min(int(lengths[doc]), stop - at)))
            i += 1
        first, last = np.searchsorted(permuted_starts, [start, start + self.seq_len])
        return np.concatenate(pieces), permuted_starts[first:last] - start

    def _order(self, epoch: int) -> tuple[np.ndarray, np.ndarray]:
        """The epoch's permutation (of windows, or of documents with the permuted stream's document starts);
        the last two epochs are kept (a global batch can straddle two)."""
        if epoch not in self._epochs:
            assert self.seed is not None, "a shuffled order needs a seed"
            if self.shuffle == "windows":
                self._epochs[epoch] = (epoch_permutation(self.n_windows, self.seed, epoch), np.empty(0, np.int64))
            else:
                perm = epoch_permutation(self.store.n_documents, self.seed, epoch)
                lengths = self._lengths[perm]
                self._epochs[epoch] = (perm, np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64))
            for old in sorted(self._epochs)[:-2]:
                del self._epochs[old]
        return self._epochs[epoch]

    @cached_property
    def _lengths(self) -> np.ndarray:
        starts = self.store.doc_starts
        return np.diff(np.append(starts, self.store.n_tokens))
