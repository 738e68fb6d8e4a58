"""Packing: tokenised documents laid end to end and cut into fixed windows.

Every document is ``BOS tokens EOS``; documents are concatenated into one token stream, which is cut
into consecutive, non-overlapping windows of ``seq_len + 1`` tokens (a stream is packed here as it is read;
a token store holds the same stream, and ``windows.py`` cuts it the same way): window ``k`` is stream tokens
``[k (seq_len+1), (k+1) (seq_len+1))``. A window gives ``inputs = w[:-1]`` and ``labels = w[1:]``,
so each position predicts the next token, across document boundaries too (attention is not masked
per document). Windows never pad: the stream's tail that does not fill a window stays in the buffer
until more documents arrive, or is dropped when a finite pass ends.

The buffer is a numpy int32 array (token ids fit easily), so concatenation and cutting run in C.
"""
from __future__ import annotations

import itertools
from collections.abc import Sequence

import numpy as np

TOKEN_DTYPE = np.int32


def empty_buffer() -> np.ndarray:
    return np.empty(0, dtype=TOKEN_DTYPE)


def append_documents(buffer: np.ndarray, token_lists: Sequence[Sequence[int]]) -> np.ndarray:
    """``buffer`` followed by every document's tokens, in order."""
    total = sum(map(len, token_lists))
    tokens = np.fromiter(itertools.chain.from_iterable(token_lists), dtype=TOKEN_DTYPE, count=total)
    return np.concatenate([buffer, tokens])


def cut_windows(buffer: np.ndarray, n_windows: int, window: int) -> tuple[np.ndarray, np.ndarray]:
    """The first ``n_windows`` windows of ``window`` tokens as an [n, window] array, and the rest.

    The rest is copied so the consumed prefix can be freed.
    """
    used = n_windows * window
    if used > len(buffer):
        raise ValueError(f"{n_windows} windows of {window} tokens need {used} tokens, the buffer has {len(buffer)}")
    return buffer[:used].reshape(n_windows, window), buffer[used:].copy()
