"""What a data loader hands out: ``(inputs, labels)`` and where each row's documents start."""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch


class Batch(tuple):
    """``(inputs, labels)``, int64 [B, S] each, with ``doc_starts``.

    It unpacks as that pair, so every consumer that does not mask attention per document (the step runners,
    validation, pipelining) reads it unchanged. ``doc_starts[i]`` is an int64 tensor of the positions of
    ``inputs[i]`` that hold a document's first token (its BOS), ascending; a row whose first position has
    none continues a document that began in an earlier window.
    """

    doc_starts: list[torch.Tensor]

    def __new__(cls, inputs: torch.Tensor, labels: torch.Tensor, doc_starts: list[torch.Tensor]) -> Batch:
        batch = super().__new__(cls, (inputs, labels))
        batch.doc_starts = doc_starts
        return batch

    def __getnewargs__(self) -> tuple:  # pickling rebuilds all three fields
        return self[0], self[1], self.doc_starts

    @property
    def inputs(self) -> torch.Tensor:
        return self[0]

    @property
    def labels(self) -> torch.Tensor:
        return self[1]

    def document_ids(self) -> torch.Tensor:
        """int64 [B, S]: for each position, which document of its row it belongs to (0 for the part before
        the row's first start). Two positions may attend to each other under a document mask when equal."""
        marks = torch.zeros(self[0].shape, dtype=torch.int64)
        for row, starts in enumerate(self.doc_starts):
            marks[row, starts[starts > 0]] = 1
        return marks.cumsum(dim=1)


def to_batch(windows: np.ndarray, doc_starts: Sequence[np.ndarray]) -> Batch:
    """A ``Batch`` from windows [n, seq_len + 1] and each window's document starts (positions < seq_len)."""
    block = torch.from_numpy(windows.astype(np.int64))
    return Batch(block[:, :-1].contiguous(), block[:, 1:].contiguous(),
                 [torch.from_numpy(np.asarray(s, dtype=np.int64)) for s in doc_starts])
