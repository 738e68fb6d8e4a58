"""The loader of streams (``data.streaming``): documents -> tokens -> packed windows -> batches.

Pipeline per data-parallel rank:

1. ``sources.load_split`` opens the split as a streaming ``IterableDataset``, which
   ``datasets.distributed.split_dataset_by_node`` splits: whole shards (files) per rank when their number
   divides by the data-parallel degree, otherwise every ``dp_world_size``-th document.
2. Documents are read lazily in groups of ``DOCS_PER_ENCODE`` and tokenised with one batched tokenizer
   call per group, then packed (see ``packing.py``) into ``seq_len + 1`` windows. A document over
   ``LARGE_DOCUMENT_CHARS`` is streamed instead (``chunked_encode.py``): its tokens reach the packer
   chunk by chunk, so its first windows come out after its first chunk is tokenised.

Training (``infinite=True``) loops over epochs forever, in the stream's stable shard order. A finite pass
(``infinite=False``, e.g. validation) yields every full window once, the last batch possibly holding
fewer than ``local_batch_size`` windows, and drops the final partial window. Ranks may produce different
numbers of batches in a finite pass. Document starts in a batch are the positions of the tokenizer's BOS.

``state_dict()`` is the position after the last batch handed out: epoch, how many documents are consumed
and the streaming dataset's own resumable state, within the next group of documents how many are already
tokenised and how many characters of the next one (a streamed document stopped at a chunk boundary), and
the tokens read but not yet batched. It resumes on the same data-parallel degree only (each rank's state
is its own shard reader's). It holds only ints, strings, lists, dicts and one tensor, so it loads with
``torch.load(weights_only=True)``.
"""
from __future__ import annotations

import functools
import logging
import math
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any, Literal, NamedTuple

import numpy as np
import torch

from torchtitan_lite.components.data.batch import Batch
from torchtitan_lite.components.data.batch import to_batch as windows_to_batch
from torchtitan_lite.components.data.chunked_encode import encode_large, is_large, specials
from torchtitan_lite.components.data.errors import DataSourceError
from torchtitan_lite.components.data.layout import reshard_refusal
from torchtitan_lite.components.data.live_iterator import SingleLiveIterator
from torchtitan_lite.components.data.loader_args import LoaderConfig, check_build_args
from torchtitan_lite.components.data.packing import append_documents, cut_windows, empty_buffer
from torchtitan_lite.components.data.records import bad_record_error, log_skipped
from torchtitan_lite.components.data.shuffle_buffer import ShuffleBuffer
from torchtitan_lite.components.data.sources import load_split

DOCS_PER_ENCODE = 16
"""Documents tokenised per SentencePiece call: large enough to amortise the call, small enough that
the leftover token buffer (saved in checkpoints) stays small."""
STATE_FORMAT = 2
"""A stream's state has kept format 2 (random-access sources write 3, ``window_loader.py``)."""
_MISSING = object()
"""A streamed record without the text field."""
_LAYOUT_KEYS = ("format", "dataset", "split", "streaming", "seq_len", "vocab_size")
"""What a data position is only valid for, whatever the data-parallel layout."""

logger = logging.getLogger(__name__)


class _Group(NamedTuple):
    """Documents read together, and the source position after them (committed once all are tokenised).

    ``texts`` has one entry per item read (None for a skipped bad record)."""

    texts: list[str | None]
    end_position: int
    end_stream_state: dict | None


class StreamLoader(SingleLiveIterator):
    """Batches of packed token windows of a stream (``Batch``: inputs, labels, document starts)."""

    def __init__(
        self,
        config: LoaderConfig,
        *,
        tokenizer: Any,
        dp_rank: int,
        dp_world_size: int,
        seq_len: int,
        local_batch_size: int,
        split: Literal["train", "validation"] = "train",
        infinite: bool = True,
        seed: int | None = None,
        batches_per_step: int = 1,
        vocab_size: int | None = None,
    ) -> None:
        """``batches_per_step``: local batches one optimizer step reads (gradient accumulation); only the warning
        about a split smaller than one step uses it. ``vocab_size`` (the model's) is unused: a stream's ids come
        from the run's own tokenizer. ``seed`` seeds the training pass's shuffle buffer (data.shuffle_buffer)."""
        del vocab_size
        self.config = config
        check_build_args(dp_rank, dp_world_size, seq_len, local_batch_size, split)
        self.tokenizer = tokenizer
        self.dp_rank, self.dp_world_size = dp_rank, dp_world_size
        self.seq_len, self.local_batch_size = seq_len, local_batch_size
        self.split, self.infinite = split, infinite
        self.batches_per_step = batches_per_step
        # datasets is imported when a loader is built, never by inspection commands (--help, --list-configs).
        from datasets.distributed import split_dataset_by_node

        self.documents = split_dataset_by_node(load_split(config, split), rank=dp_rank, world_size=dp_world_size)
        self._bad_records: Counter = Counter()  # skipped bad records per reason (data.on_bad_record=skip)
        bos = specials(tokenizer)[0]
        # A document starts where its BOS is (a tokenizer without a single BOS token marks none).
        self._bos = bos[0] if len(bos) == 1 else None
        self._epoch = 0
        self._position = 0  # documents of this rank's stream already tokenised
        self._stream_state: dict | None = None  # IterableDataset.state_dict() after those documents
        # Of the group read from there on: documents already tokenised, and characters of the next one.
        self._resume_doc, self._resume_char = 0, 0
        self._buffer = empty_buffer()
        # Validation reads the stream in order; training through the buffer when data.shuffle_buffer is set.
        self._shuffle = None
        if config.shuffle_buffer and split == "train" and infinite:
            if seed is None:
                raise ValueError("data.shuffle_buffer needs a seed shared by the ranks (training.seed)")
            self._shuffle = ShuffleBuffer(config.shuffle_buffer, seed, dp_rank, seq_len + 1)
        self._pass_has_content = False
        self._pass_tokens = 0  # tokens this rank read in the current pass over its documents
        self._warned_small = False

    # ----------------------------------------------------------------------------------------------
    # Iteration

    def _batches(self, token: object) -> Iterator[Batch]:
        if self._shuffle is not None:
            yield from self._shuffled_batches(token)
            return
        window = self.seq_len + 1
        needed = self.local_batch_size * window
        pieces = self._token_pieces()
        while True:
            self._check_live(token)
            while len(self._buffer) < needed:
                token_lists = next(pieces, None)
                if token_lists is None:  # a finite pass ended: the last full windows, then stop
                    n_windows = len(self._buffer) // window
                    if n_windows:
                        windows, self._buffer = cut_windows(self._buffer, n_windows, window)
                        yield self._to_batch(windows)
                    return
                self._add_tokens(token_lists)
            windows, self._buffer = cut_windows(self._buffer, self.local_batch_size, window)
            yield self._to_batch(windows)

    def _shuffled_batches(self, token: object) -> Iterator[Batch]:
        """Training through the shuffle buffer: every window cut from the stream goes into the buffer at once,
        and a batch is the next ``local_batch_size`` windows it hands out. Nothing is held between a window's
        cut and its place in the buffer or the batch, so the state between two batches is whole."""
        assert self._shuffle is not None
        window = self.seq_len + 1
        pieces = self._token_pieces()
        rows: list[np.ndarray] = []
        while True:
            self._check_live(token)
            while len(self._buffer) < window:
                token_lists = next(pieces, None)
                assert token_lists is not None, "a training stream is infinite"
                self._add_tokens(token_lists)
            while len(self._buffer) >= window and len(rows) < self.local_batch_size:
                cut, self._buffer = cut_windows(self._buffer, 1, window)
                out = self._shuffle.push(cut[0].copy())
                if out is not None:
                    rows.append(out)
            if len(rows) == self.local_batch_size:
                yield self._to_batch(np.stack(rows))
                rows = []

    def _add_tokens(self, token_lists: list[list[int]]) -> None:
        self._buffer = append_documents(self._buffer, token_lists)
        self._pass_tokens += sum(len(tokens) for tokens in token_lists)

    def _to_batch(self, windows: np.ndarray) -> Batch:
        starts = [np.flatnonzero(w[:-1] == self._bos) if self._bos is not None else np.empty(0, np.int64)
                  for w in windows]
        return windows_to_batch(windows, starts)

    def _token_pieces(self) -> Iterator[list[list[int]]]:
        """Token lists to append to the buffer, in document order: the small documents of a group in one
        batched call, a large one piece by piece. When a piece is handed out the loader's position already
        counts it: the caller appends it before anything can read the state."""
        for group in self._document_groups():
            texts, first, first_char = group.texts, self._resume_doc, self._resume_char
            starts = [first_char if i == first else 0 for i in range(len(texts))]
            small = [i for i in range(first, len(texts)) if (text := texts[i]) is not None and not is_large(text)
                     and not starts[i]]
            encoded = dict(zip(small, self.tokenizer.encode_batch([texts[i] for i in small]) if small else []))
            # BOS + EOS alone is an empty document; a pass of only those trains on nothing.
            self._pass_has_content = self._pass_has_content or any(len(t) > 2 for t in encoded.values())
            run: list[list[int]] = []
            for i in range(first, len(texts)):
                text = texts[i]
                if text is None:  # a skipped bad record
                    continue
                if i in encoded:
                    run.append(encoded[i])
                    continue
                if run:
                    self._resume_doc, self._resume_char = i, 0
                    yield run
                    run = []
                self._pass_has_content = True
                for tokens, end in encode_large(self.tokenizer, text, starts[i]):
                    self._resume_doc, self._resume_char = (i, end) if end < len(text) else (i + 1, 0)
                    yield tokens
            self._position, self._stream_state = group.end_position, group.end_stream_state
            self._resume_doc, self._resume_char = 0, 0
            if run:
                yield run

    def _document_groups(self) -> Iterator[_Group]:
        """Groups of documents from the saved position on; the consumer commits each group's end
        position once its documents are tokenised, before asking for the next."""
        stream = self._stream_groups
        while True:
            produced = False
            from_start = self._position == 0 and self._resume_doc == 0 and self._resume_char == 0
            self._pass_has_content = False
            self._pass_tokens = 0
            for group in stream():
                produced = True
                yield group
            if produced and from_start and not self._pass_has_content:
                skipped = sum(self._bad_records.values())
                also = f" or a skipped bad record ({skipped} so far, data.on_bad_record=skip)" if skipped else ""
                raise DataSourceError(f"every document data-parallel rank {self.dp_rank} read from split {self.split!r} "
                                      f"of data.dataset={self.config.dataset!r} is empty (only BOS/EOS tokens){also}; "
                                      f"check data.text_field and the data")
            if not self.infinite:
                return
            if produced and from_start:
                self._warn_if_smaller_than_a_step()
            if not produced and from_start:
                raise DataSourceError(f"data-parallel rank {self.dp_rank} read no documents of split "
                                      f"{self.split!r} of data.dataset={self.config.dataset!r} in a whole "
                                      f"epoch; add data or use fewer data-parallel ranks")
            self._epoch += 1
            self._position, self._stream_state = 0, None

    def _warn_if_smaller_than_a_step(self) -> None:
        """A whole epoch of this rank's documents shorter than what one optimizer step reads makes every step
        read them several times over: legal, but rarely what was meant, so it is said once."""
        needed = self.local_batch_size * (self.seq_len + 1) * self.batches_per_step
        if self._warned_small or self._pass_tokens >= needed:
            return
        self._warned_small = True
        logger.warning(
            "split %r of data.dataset=%r gives data-parallel rank %d %d tokens per epoch, fewer than one step reads: "
            "training.local_batch_size x (training.seq_len + 1) x %d local batch(es) per step = %d x %d x %d = %d "
            "tokens, so every step repeats the same documents about %.1f times; add data, or lower "
            "training.local_batch_size / training.seq_len / training.global_batch_size",
            self.split, self.config.dataset, self.dp_rank, self._pass_tokens, self.batches_per_step,
            self.local_batch_size, self.seq_len + 1, self.batches_per_step, needed, needed / max(1, self._pass_tokens))

    def _stream_groups(self) -> Iterator[_Group]:
        """The rest of this epoch of a streaming dataset, resumed from its own state when saved."""
        self.documents.set_epoch(self._epoch)
        self.documents.load_state_dict(self._stream_state)
        field = self.config.text_field
        position, read, texts = self._position, 0, []
        for record in self.documents:
            texts.append(self._document(record.get(field, _MISSING),
                                        functools.partial(self._record_name, position + read, record)))
            read += 1
            if read == DOCS_PER_ENCODE:
                position, read = position + read, 0
                yield _Group(texts, position, self.documents.state_dict())
                texts = []
        if read:
            yield _Group(texts, position + read, self.documents.state_dict())

    # ----------------------------------------------------------------------------------------------
    # Bad records of sources that are not scanned before loading

    def _document(self, value: Any, name: Callable[[], str]) -> str | None:
        """``value`` when it is a document; a bad record is an error, or None (counted) with on_bad_record=skip."""
        if isinstance(value, str):
            return value
        field = self.config.text_field
        if value is _MISSING:
            reason, detail = "missing field", f"has no {field!r} field"
        elif value is None:
            reason, detail = "null value", f"has {field}=None (null), not a string"
        else:
            reason, detail = "non-string value", f"has {field}={value!r} ({type(value).__name__}), not a string"
        if self.config.on_bad_record == "error":
            raise bad_record_error(f"{name()} {detail}", reason)
        self._bad_records[reason] += 1
        count = sum(self._bad_records.values())
        if count <= 3 or math.log10(count).is_integer():  # the first few, then at 10, 100, 1000, ...
            log_skipped(count, self._bad_records, f"split {self.split!r} of data.dataset={self.config.dataset!r} "
                        f"on data-parallel rank {self.dp_rank} so far", [f"{name()} {detail}"])
        return None

    def _record_name(self, position: int, record: dict) -> str:
        shard = _shard_position(self.documents.state_dict())
        return (f"record {position} of data-parallel rank {self.dp_rank}'s stream of split {self.split!r} of "
                f"data.dataset={self.config.dataset!r}{shard} (fields {sorted(record)[:8]})")

    # ----------------------------------------------------------------------------------------------
    # Checkpointing

    def state_dict(self) -> dict[str, Any]:
        return {
            "format": STATE_FORMAT,
            "dataset": self.config.dataset,
            "split": self.split,
            "streaming": True,
            "dp_rank": self.dp_rank,
            "dp_world_size": self.dp_world_size,
            "seq_len": self.seq_len,
            "vocab_size": int(self.tokenizer.vocab_size),
            "epoch": self._epoch,
            "position": self._position,
            "stream_state": self._stream_state,
            "bad_records": dict(self._bad_records),
            "resume_doc": self._resume_doc,
            "resume_char": self._resume_char,
            "buffer": torch.from_numpy(self._buffer.copy()),
            **({"shuffle": self._shuffle.state_dict()} if self._shuffle is not None else {}),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from this rank's own saved state (same data-parallel layout)."""
        self._check_compatible(state)
        for key in ("dp_rank", "dp_world_size"):
            if state[key] != getattr(self, key):
                raise ValueError(
                    f"data loader state was saved with {key}={state[key]!r}, this loader has {key}="
                    f"{getattr(self, key)!r}: a stream's position is its own shard reader's and is only valid for "
                    f"the same data-parallel layout. Restore that setting, or start the data from the beginning "
                    f"by excluding 'dataloader' from checkpoint loading")
        self._epoch = int(state["epoch"])
        self._position = int(state["position"])
        self._stream_state = state["stream_state"]
        self._bad_records = Counter(state.get("bad_records", {}))
        self._resume_doc, self._resume_char = int(state["resume_doc"]), int(state["resume_char"])
        self._buffer = state["buffer"].numpy().astype(self._buffer.dtype, copy=True)
        if (self._shuffle is None) != ("shuffle" not in state):
            saved = state["shuffle"]["size"] if "shuffle" in state else 0
            now = self._shuffle.size if self._shuffle is not None else 0
            raise ValueError(f"data loader state was saved with data.shuffle_buffer={saved}, this run has {now}: the "
                             f"windows the buffer held would be lost or invented. Restore that setting, or start "
                             f"the data from the beginning by excluding 'dataloader' from checkpoint loading")
        if self._shuffle is not None:
            self._shuffle.load_state_dict(state["shuffle"])
        self._live_iterator = None

    def load_rank_states(self, states: list[dict[str, Any]]) -> None:
        """Continue from the states every rank of a checkpoint saved (tensor-parallel peers of a data-parallel
        rank saved the same one): this rank's own, on the same data-parallel degree only."""
        for state in states:
            self._check_compatible(state)
        by_rank = {int(s["dp_rank"]): s for s in states}
        saved_world = int(states[0]["dp_world_size"])
        if saved_world != self.dp_world_size or self.dp_rank not in by_rank:
            raise ValueError(reshard_refusal(saved_world, self.dp_world_size))
        self.load_state_dict(by_rank[self.dp_rank])

    def _check_compatible(self, state: dict[str, Any]) -> None:
        if state.get("format") != STATE_FORMAT or not state.get("streaming"):
            raise ValueError(
                f"data loader state has format {state.get('format')} (streaming={state.get('streaming')!r}), this "
                f"loader reads a stream's position (format {STATE_FORMAT}); start the data from the beginning by "
                f"excluding 'dataloader' from checkpoint loading")
        expected = self.state_dict()
        for key in _LAYOUT_KEYS:
            if state.get(key) != expected[key]:
                raise ValueError(
                    f"data loader state was saved with {key}={state.get(key)!r}, this loader has "
                    f"{key}={expected[key]!r}: a data position is only valid for the same data, tokenizer and "
                    f"seq_len. Restore that setting, or start the data from the beginning by excluding "
                    f"'dataloader' from checkpoint loading")


def _shard_position(state: Any) -> str:
    """', shard S' from a streaming dataset's state_dict, where it says so. (Its record count inside the
    shard moves a whole Arrow batch at a time, so it does not name the record.)"""
    if isinstance(state, dict):
        if "shard_idx" in state:
            return f", shard {state['shard_idx']}"
        for value in state.values():
            found = _shard_position(value)
            if found:
                return found
    return ""
