"""What the model needs to know about a batch's sequence beyond its tokens: where each token's document
starts (document masking) and which part of the window this rank holds (context parallelism).

A loader's ``Batch`` carries each row's document starts. ``model_batch`` turns it into the tokens this rank
feeds the model and the keyword tensors the model reads (``Decoder.forward``):

- ``positions`` [B, s]: each token's rotary position, restarting at 0 at each document's first token (the
  part of a row before its first start counts from 0 as well);
- ``q_index`` [B, s] / ``kv_index`` [B, S]: the window position of each local query and of each key, in the
  order the keys reach the attention (all of them under context parallelism, after the gather);
- ``q_doc`` [B, s] / ``kv_doc`` [B, S]: the document of each, from ``Batch.document_ids``.

A query attends to a key when ``kv_index <= q_index`` and ``kv_doc == q_doc``. Under the plain causal mask on
one rank nothing is passed, and the model runs its ``is_causal`` attention exactly as without this module.

Context parallelism splits the window into ``2 * cp`` chunks and gives rank r chunks r and 2cp-1-r (head and
tail), so that under a causal mask every rank attends to the same number of (query, key) pairs.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from torchtitan_lite.components.data.batch import Batch
from torchtitan_lite.components.data.chunked_encode import specials


def load_balanced_index(seq_len: int, cp: int, rank: int) -> torch.Tensor:
    """int64 [seq_len // cp]: the window positions rank ``rank`` of ``cp`` holds, chunks rank and 2cp-1-rank."""
    if seq_len % (2 * cp):
        raise ValueError(f"a window of {seq_len} tokens does not split into 2 x cp = {2 * cp} equal chunks")
    chunk = seq_len // (2 * cp)
    head, tail = rank * chunk, (2 * cp - 1 - rank) * chunk
    return torch.cat([torch.arange(head, head + chunk), torch.arange(tail, tail + chunk)])


def document_positions(document_ids: torch.Tensor) -> torch.Tensor:
    """int64 [B, S]: each position's offset from its document's first position (0 at every start)."""
    seq_len = document_ids.shape[1]
    index = torch.arange(seq_len).expand_as(document_ids)
    starts = torch.ones_like(document_ids, dtype=torch.bool)
    starts[:, 1:] = document_ids[:, 1:] != document_ids[:, :-1]
    # The last start at or before each position, carried forward by a running maximum.
    first = torch.where(starts, index, torch.zeros_like(index)).cummax(dim=1).values
    return index - first


@dataclass(frozen=True)
class ModelBatch:
    """The tokens one rank feeds the model for one micro-batch, and the keyword tensors its forward reads."""

    inputs: torch.Tensor
    labels: torch.Tensor
    model_kwargs: dict[str, torch.Tensor]
    attention_share: float
    """Attended (query, key) pairs over those of the plain causal mask on the whole window (1.0 for causal):
    what MFU scales the attention FLOPs by."""

    def to(self, device: torch.device | str, *, non_blocking: bool = False) -> ModelBatch:
        move = lambda t: t.to(device, non_blocking=non_blocking)  # noqa: E731
        return ModelBatch(move(self.inputs), move(self.labels), {k: move(v) for k, v in self.model_kwargs.items()},
                          self.attention_share)


def model_batch(batch: Batch, *, document_mask: bool, cp: int = 1, cp_rank: int = 0) -> ModelBatch:
    inputs, labels = batch
    if not document_mask and cp == 1:
        return ModelBatch(inputs, labels, {}, 1.0)
    bsz, seq_len = inputs.shape
    # One rank holds the whole window: no chunk to pick, the keys in window order.
    local: torch.Tensor | slice = load_balanced_index(seq_len, cp, cp_rank) if cp > 1 else slice(None)
    keys: torch.Tensor | slice = \
        torch.cat([load_balanced_index(seq_len, cp, r) for r in range(cp)]) if cp > 1 else slice(None)
    window = torch.arange(seq_len).expand(bsz, seq_len)
    kwargs = {"q_index": window[:, local], "kv_index": window[:, keys]}
    if not document_mask:
        return ModelBatch(inputs[:, local], labels[:, local], {"positions": window[:, local], **kwargs}, 1.0)
    docs = batch.document_ids()
    kwargs |= {"positions": document_positions(docs)[:, local], "q_doc": docs[:, local], "kv_doc": docs[:, keys]}
    return ModelBatch(inputs[:, local], labels[:, local], kwargs, attention_share(docs))


def attention_share(document_ids: torch.Tensor) -> float:
    """Pairs a document-causal mask attends over those of the causal mask, over a batch's rows."""
    seq_len = document_ids.shape[1]
    lengths = [torch.unique_consecutive(row, return_counts=True)[1] for row in document_ids]
    attended = sum(int((n * (n + 1) // 2).sum()) for n in lengths)
    return attended / (len(lengths) * seq_len * (seq_len + 1) // 2)


@dataclass(frozen=True)
class SequenceLayout:
    """How this run lays a loader's batches out for the model: the trainer and the validator both call it."""

    document_mask: bool = False
    cp: int = 1
    cp_rank: int = 0

    def __call__(self, batch: tuple[torch.Tensor, torch.Tensor]) -> ModelBatch:
        if not isinstance(batch, Batch):
            if self.document_mask:
                raise TypeError("model.attention_mask='document' needs batches that carry their document starts "
                                "(components/data/batch.py's Batch); got a plain (inputs, labels) pair")
            batch = Batch(batch[0], batch[1], [])
        return model_batch(batch, document_mask=self.document_mask, cp=self.cp, cp_rank=self.cp_rank)


def check_document_starts(document_mask: bool, *, streaming: bool, tokenizer: Any) -> None:
    """A stream marks where documents start by the tokenizer's BOS token (a token store keeps its own index):
    document masking over a stream needs a tokenizer that puts exactly one before each document."""
    if not (document_mask and streaming):
        return
    bos = specials(tokenizer)[0]
    if len(bos) != 1:
        raise ValueError(
            f"model.attention_mask='document' over a stream (data.streaming=true) finds documents by the tokenizer's "
            f"BOS token, but {tokenizer.describe()} puts {len(bos)} token(s) before a document: every window would "
            "read as one document. Use a tokenizer with a BOS token, pre-tokenize the data into a token store "
            "(scripts/pretokenize.py), or set model.attention_mask='causal'")
