"""The text data loader: documents -> tokens -> packed windows -> batches, with exact resume.

Pipeline per data-parallel rank:

1. ``sources.load_split`` opens the split through ``datasets`` (map-style, or streaming).
2. Each rank reads disjoint documents. A map-style split is read in one global order per epoch (a
   permutation seeded by ``(seed, epoch)`` with ``data.shuffle``, the file order otherwise): rank ``r``
   of ``D`` reads order positions ``r, r + D, r + 2D, ...`` (see ``position.py``), which lets a
   checkpointed position reshard to another data-parallel degree. A streaming split goes through
   ``datasets.distributed.split_dataset_by_node``: whole shards (files) per rank when their number
   divides by the data-parallel degree, otherwise every ``dp_world_size``-th document; its position
   resumes on the same degree only.
3. Documents are read lazily in groups of ``DOCS_PER_ENCODE`` and tokenised with one batched
   SentencePiece call per group, then packed (see ``packing.py``) into ``seq_len + 1`` windows. A
   document over ``LARGE_DOCUMENT_CHARS`` is streamed instead (``chunked_encode.py``): its tokens
   reach the packer chunk by chunk, so its first windows come out after its first chunk is tokenised.

Training (``infinite=True``) loops over epochs forever; with ``data.shuffle`` a map-style training
split is read in a fresh permutation each epoch, seeded by ``(seed, epoch)`` (the same seed on every
rank: the ranks share the order). A finite pass
(``infinite=False``, e.g. validation) yields every full window once, the last batch possibly holding
fewer than ``local_batch_size`` windows, and drops the final partial window. Ranks may produce
different numbers of batches in a finite pass.

``state_dict()`` is the position after the last batch handed out: epoch, this rank's sequence of order
positions (``pending``, ``stride_start``, ``stride``) and how many of its documents are consumed (or
the streaming dataset's own resumable state), within the next group of documents how many are already
tokenised and how many characters of the next one (a streamed document stopped at a chunk boundary),
the shuffle seed and the tokens read but not yet batched. ``load_rank_states()`` takes the states of
every rank of a checkpoint and reshards them when the data-parallel degree changed (map-style only).
It holds only ints, strings, lists, dicts and one tensor, so it loads with ``torch.load(weights_only=True)``.
"""
from __future__ import annotations

import functools
import logging
import math
import os
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, ClassVar, Literal, NamedTuple

import numpy as np
import torch

from torchtitan_lite.components.data.chunked_encode import encode_large, is_large
from torchtitan_lite.components.data.layout import reshard_refusal
from torchtitan_lite.components.data.packing import append_documents, cut_windows, empty_buffer, to_batch
from torchtitan_lite.components.data.position import RankPosition, reshard
from torchtitan_lite.components.data.records import bad_record_error, log_skipped
from torchtitan_lite.components.data.sources import DataFormat, DataSourceError, load_split
from torchtitan_lite.config import Configurable

DOCS_PER_ENCODE = 16
"""Documents tokenised per SentencePiece call: large enough to amortise the call, small enough that
the leftover token buffer (saved in checkpoints) stays small."""
STATE_FORMAT = 2
"""2: map-style splits are read in one global order shared by the ranks (1: a contiguous part per rank)."""
_MISSING = object()
"""A streamed record without the text field."""
_LAYOUT_KEYS = ("format", "dataset", "split", "streaming", "seq_len", "vocab_size", "n_documents")
"""What a data position is only valid for, whatever the data-parallel layout."""

logger = logging.getLogger(__name__)


class _Group(NamedTuple):
    """Documents read together, and the source position after them (committed once all are tokenised).

    ``texts`` has one entry per item read (None for a skipped bad record), ``starts`` the character each
    is read from (0, or where another rank stopped reading it before a reshard)."""

    texts: list[str | None]
    starts: list[int]
    end_position: int
    end_stream_state: dict | None


class TextDataLoader(Configurable):
    """Batches of packed token windows ``(inputs, labels)``, each a LongTensor [B, S] on CPU."""

    @dataclass(kw_only=True)
    class Config(Configurable.Config):
        dataset: str = "embedded"
        """'embedded' (the Python standard library's sources, built offline into the cache); a local
        file or glob (data/*.jsonl, **/*.parquet); a local dataset folder (splits named by file, like a
        hub repository, or written by save_to_disk); or a Hugging Face hub dataset name."""
        dataset_config: str | None = None
        """Configuration (subset) name of a hub dataset or dataset folder; None for the default. It belongs
        to the dataset it is set with: overriding data.dataset without it resets it to None."""
        belongs_to: ClassVar[dict[str, str]] = {"dataset_config": "dataset"}
        # Read by the overrides: a config's 'sample-10BT' describes its hub dataset and must not follow
        # --data.dataset embedded (or a local file) into a run where it cannot apply.
        data_format: DataFormat = "auto"
        """Format of local files: json / jsonl (one JSON record per line or a JSON array), parquet,
        text (one document per line), csv; 'auto' infers it from the file extension."""
        text_field: str = "text"
        """Record field (column) holding the document text."""
        train_split: str = "train"
        """Split to train on (for local files and globs: the name the files are loaded under)."""
        validation_split: str = "validation"
        """Split to validate on; replaced by validation_files when that is set."""
        validation_files: str | None = None
        """Local file or glob of validation documents, used instead of the dataset's validation split
        (required for validation when dataset is a file or glob). Same format rules as dataset."""
        streaming: bool = False
        """Read the source as a streaming IterableDataset (no Arrow cache, no full download first)."""
        shuffle: bool = True
        """Read the training split in a new random document order every epoch (seeded by
        training.seed and the epoch, exactly resumable). Needs a map-style dataset: streaming
        datasets are read in their stable shard order, so set it to false with streaming."""
        on_bad_record: Literal["error", "skip"] = "error"
        """A bad record: in local JSON-lines, JSON, text, CSV or Parquet files, compressed or not (invalid
        UTF-8 or JSON, missing field or column, null or non-string value, malformed CSV row), found
        before training; in other sources (hub, dataset folders, streams) a record whose text field is
        missing or not a string, found when read. 'error' stops naming file and line or row (dataset,
        shard and record); 'skip' leaves such records out, logging how many per reason (the remaining
        documents resume exactly like any other source)."""

        def __post_init__(self) -> None:
            if not self.dataset:
                raise ValueError("data.dataset is empty; use 'embedded', a local path or glob, or a hub name")
            if not self.text_field:
                raise ValueError("data.text_field is empty; name the field that holds the document text")
            if self.streaming and self.shuffle:
                raise ValueError("data.shuffle=True needs a map-style dataset, but data.streaming=True; a "
                                 "streaming dataset is read in its stable shard order so that it resumes "
                                 "exactly: set data.shuffle=false (or data.streaming=false)")

    config: TextDataLoader.Config

    def __init__(
        self,
        config: TextDataLoader.Config,
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
    ) -> None:
        """``batches_per_step``: local batches one optimizer step reads (gradient accumulation); only the warning
        about a split smaller than one step uses it."""
        super().__init__(config)
        _check_build_args(dp_rank, dp_world_size, seq_len, local_batch_size, split)
        self.tokenizer = tokenizer
        self.dp_rank, self.dp_world_size = dp_rank, dp_world_size
        self.seq_len, self.local_batch_size = seq_len, local_batch_size
        self.split, self.infinite = split, infinite
        self.batches_per_step = batches_per_step
        # datasets is imported when a loader is built, never by inspection commands (--help, --list-configs).
        from datasets import Dataset
        from datasets.distributed import split_dataset_by_node

        documents = load_split(config, split)
        if isinstance(documents, Dataset) and len(documents) < dp_world_size:
            raise DataSourceError(
                f"split {split!r} of data.dataset={config.dataset!r} has {len(documents)} document(s), fewer "
                f"than the {dp_world_size} data-parallel ranks that each need some; add data or use fewer "
                f"data-parallel ranks")
        # A map-style split stays whole: the ranks read disjoint positions of one order (position.py).
        self.documents = documents if isinstance(documents, Dataset) else \
            split_dataset_by_node(documents, rank=dp_rank, world_size=dp_world_size)
        self._n_documents = len(documents) if isinstance(documents, Dataset) else None
        self._bad_records: Counter = Counter()  # skipped bad records per reason (data.on_bad_record=skip)
        self.shuffle = config.shuffle and split == "train"
        if self.shuffle and seed is None and dp_world_size > 1:
            raise ValueError(f"data.shuffle on {dp_world_size} data-parallel ranks needs one seed shared by every "
                             f"rank (they read positions of one shuffled order); pass seed= (the trainer draws one "
                             f"on rank 0 when training.seed is None)")
        # Without a seed the order is still random but recorded, so a resumed run continues it.
        self.seed = None if not self.shuffle else seed if seed is not None else int.from_bytes(os.urandom(4), "big")
        # Epoch and this rank's sequence of order positions in it (map-style); read/char/buffer live below.
        self._sequence = RankPosition(dp_rank, dp_world_size)
        self._position = 0  # items of this rank's sequence (or stream) already tokenised
        self._stream_state: dict | None = None  # IterableDataset.state_dict() after those documents
        # Of the group read from there on: documents already tokenised, and characters of the next one.
        self._resume_doc, self._resume_char = 0, 0
        self._buffer = empty_buffer()
        self._live_iterator: object | None = None
        self._pass_has_content = False
        self._pass_tokens = 0  # tokens this rank read in the current pass over its documents
        self._warned_small = False

    # ----------------------------------------------------------------------------------------------
    # Iteration

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """Batches from the current position on. Only the newest iterator of a loader is usable."""
        token = object()
        self._live_iterator = token
        return self._batches(token)

    def _batches(self, token: object) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        window = self.seq_len + 1
        needed = self.local_batch_size * window
        pieces = self._token_pieces()
        while True:
            if self._live_iterator is not token:
                raise RuntimeError("this data loader iterator is stale: a newer iterator was created or "
                                   "load_state_dict() was called; call iter(loader) again")
            while len(self._buffer) < needed:
                token_lists = next(pieces, None)
                if token_lists is None:  # a finite pass ended: the last full windows, then stop
                    n_windows = len(self._buffer) // window
                    if n_windows:
                        windows, self._buffer = cut_windows(self._buffer, n_windows, window)
                        yield to_batch(windows)
                    return
                self._buffer = append_documents(self._buffer, token_lists)
                self._pass_tokens += sum(len(tokens) for tokens in token_lists)
            windows, self._buffer = cut_windows(self._buffer, self.local_batch_size, window)
            yield to_batch(windows)

    def _token_pieces(self) -> Iterator[list[list[int]]]:
        """Token lists to append to the buffer, in document order: the small documents of a group in one
        batched call, a large one piece by piece. When a piece is handed out the loader's position already
        counts it: the caller appends it before anything can read the state."""
        for group in self._document_groups():
            texts, first, first_char = group.texts, self._resume_doc, self._resume_char
            starts = [first_char if i == first and first_char else group.starts[i] for i in range(len(texts))]
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
        from datasets import IterableDataset

        stream = self._stream_groups if isinstance(self.documents, IterableDataset) else self._indexed_groups
        while True:
            produced = False
            from_start = self._position == 0 and self._resume_doc == 0 and self._resume_char == 0 \
                and self._sequence.at_epoch_start
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
            self._sequence.next_epoch()
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

    def _indexed_groups(self) -> Iterator[_Group]:
        """The rest of this rank's sequence of this epoch of a map-style dataset (position.py)."""
        n = len(self.documents)
        sequence = self._sequence
        order = np.random.default_rng([self.seed or 0, sequence.epoch]).permutation(n) if self.shuffle else None
        field = self.config.text_field
        start, length = self._position, sequence.length(n)
        while start < length:
            stop = min(start + DOCS_PER_ENCODE, length)
            items = [sequence.item(i) for i in range(start, stop)]
            rows = [p if order is None else int(order[p]) for p, _ in items]
            values = self.documents[rows][field]
            texts = [self._document(value, functools.partial(self._row_name, row))
                     for value, row in zip(values, rows, strict=True)]
            yield _Group(texts, [c for _, c in items], stop, None)
            start = stop

    def _stream_groups(self) -> Iterator[_Group]:
        """The rest of this epoch of a streaming dataset, resumed from its own state when saved."""
        self.documents.set_epoch(self._sequence.epoch)
        self.documents.load_state_dict(self._stream_state)
        field = self.config.text_field
        position, read, texts = self._position, 0, []
        for record in self.documents:
            texts.append(self._document(record.get(field, _MISSING),
                                        functools.partial(self._record_name, position + read, record)))
            read += 1
            if read == DOCS_PER_ENCODE:
                position, read = position + read, 0
                yield _Group(texts, [0] * len(texts), position, self.documents.state_dict())
                texts = []
        if read:
            yield _Group(texts, [0] * len(texts), position + read, self.documents.state_dict())

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

    def _row_name(self, row: int) -> str:
        return (f"row {row} of split {self.split!r} of data.dataset={self.config.dataset!r} "
                f"(data-parallel rank {self.dp_rank})")

    def _record_name(self, position: int, record: dict) -> str:
        shard = _shard_position(self.documents.state_dict())
        return (f"record {position} of data-parallel rank {self.dp_rank}'s stream of split {self.split!r} of "
                f"data.dataset={self.config.dataset!r}{shard} (fields {sorted(record)[:8]})")

    # ----------------------------------------------------------------------------------------------
    # Checkpointing

    def state_dict(self) -> dict[str, Any]:
        from datasets import IterableDataset

        sequence = self._sequence
        return {
            "format": STATE_FORMAT,
            "dataset": self.config.dataset,
            "split": self.split,
            "streaming": isinstance(self.documents, IterableDataset),
            "n_documents": self._n_documents,
            "dp_rank": self.dp_rank,
            "dp_world_size": self.dp_world_size,
            "seq_len": self.seq_len,
            "vocab_size": int(self.tokenizer.vocab_size),
            "shuffle_seed": self.seed,
            "epoch": sequence.epoch,
            "pending": [list(item) for item in sequence.pending],
            "stride_start": sequence.stride_start,
            "stride": sequence.stride,
            "position": self._position,
            "stream_state": self._stream_state,
            "bad_records": dict(self._bad_records),
            "resume_doc": self._resume_doc,
            "resume_char": self._resume_char,
            "buffer": torch.from_numpy(self._buffer.copy()),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from this rank's own saved state (same data-parallel layout)."""
        self._check_compatible(state)
        for key in ("dp_rank", "dp_world_size"):
            if state[key] != getattr(self, key):
                raise ValueError(
                    f"data loader state was saved with {key}={state[key]!r}, this loader has {key}="
                    f"{getattr(self, key)!r}: one rank's state is only valid for the same data-parallel layout; "
                    f"load_rank_states() reshards the states of all ranks. Restore that setting, or start the "
                    f"data from the beginning by excluding 'dataloader' from checkpoint loading")
        self.seed = state["shuffle_seed"]
        self._sequence = RankPosition(self.dp_rank, self.dp_world_size, int(state["epoch"]),
                                      [(int(p), int(c)) for p, c in state["pending"]], int(state["stride_start"]),
                                      int(state["stride"]))
        self._position = int(state["position"])
        self._stream_state = state["stream_state"]
        self._bad_records = Counter(state.get("bad_records", {}))
        self._resume_doc, self._resume_char = int(state["resume_doc"]), int(state["resume_char"])
        self._buffer = state["buffer"].numpy().astype(self._buffer.dtype, copy=True)
        self._live_iterator = None

    def load_rank_states(self, states: list[dict[str, Any]]) -> None:
        """Continue from the states every rank of a checkpoint saved (tensor-parallel peers of a data-parallel
        rank saved the same one). On another data-parallel degree a map-style position is resharded
        (``position.py``: no document of the epoch repeated or skipped); a streaming one cannot be."""
        for state in states:
            self._check_compatible(state)
        by_rank = {int(s["dp_rank"]): s for s in states}
        saved_world = int(states[0]["dp_world_size"])
        if saved_world == self.dp_world_size and self.dp_rank in by_rank:
            self.load_state_dict(by_rank[self.dp_rank])
            return
        if self._n_documents is None:
            raise ValueError(reshard_refusal(saved_world, self.dp_world_size))
        old = [_rank_position(by_rank[r]) for r in sorted(by_rank)]
        position = reshard(old, self.dp_rank, self.dp_world_size, self._n_documents)
        self.seed = states[0]["shuffle_seed"]
        self._sequence = RankPosition(self.dp_rank, self.dp_world_size, position.epoch, position.pending,
                                      position.stride_start, position.stride)
        self._position, self._resume_doc, self._resume_char = 0, 0, 0
        self._stream_state = None
        self._buffer = position.buffer
        self._bad_records = Counter()
        if self.dp_rank == 0:
            for state in by_rank.values():
                self._bad_records.update(state.get("bad_records", {}))
        self._live_iterator = None
        logger.info("data position resharded from %d to %d data-parallel rank(s): rank %d continues epoch %d with "
                    "%d carried-over token(s), %d document(s) the old ranks had left below order position %d, then "
                    "positions %d, %d + %d, ...", saved_world, self.dp_world_size, self.dp_rank, position.epoch,
                    len(position.buffer), len(position.pending), position.stride_start - self.dp_rank,
                    position.stride_start, position.stride_start, position.stride)

    def _check_compatible(self, state: dict[str, Any]) -> None:
        if state.get("format") != STATE_FORMAT and state.get("format") is not None:
            raise ValueError(
                f"data loader state has format {state.get('format')}, this loader writes format {STATE_FORMAT} "
                f"(map-style data is now read in one order shared by the ranks, so an older position names other "
                f"documents); start the data from the beginning by excluding 'dataloader' from checkpoint loading")
        expected = self.state_dict()
        for key in _LAYOUT_KEYS:
            if state.get(key) != expected[key]:
                raise ValueError(
                    f"data loader state was saved with {key}={state.get(key)!r}, this loader has "
                    f"{key}={expected[key]!r}: a data position is only valid for the same data, tokenizer and "
                    f"seq_len. Restore that setting, or start the data from the beginning by excluding "
                    f"'dataloader' from checkpoint loading")
        if (state["shuffle_seed"] is None) != (self.seed is None):
            raise ValueError(f"data loader state was saved with data.shuffle={state['shuffle_seed'] is not None}, "
                             f"this loader has data.shuffle={self.seed is not None}; restore data.shuffle or "
                             f"exclude 'dataloader' from checkpoint loading")


def _rank_position(state: dict[str, Any]) -> RankPosition:
    """The layout-independent part of one rank's saved state."""
    return RankPosition(int(state["dp_rank"]), int(state["dp_world_size"]), int(state["epoch"]),
                        [(int(p), int(c)) for p, c in state["pending"]], int(state["stride_start"]),
                        int(state["stride"]), int(state["position"]) + int(state["resume_doc"]),
                        int(state["resume_char"]), state["buffer"].numpy())


def _check_build_args(dp_rank: int, dp_world_size: int, seq_len: int, local_batch_size: int, split: str) -> None:
    if dp_world_size < 1 or not 0 <= dp_rank < dp_world_size:
        raise ValueError(f"dp_rank={dp_rank} is not a rank of dp_world_size={dp_world_size}")
    if seq_len < 1 or local_batch_size < 1:
        raise ValueError(f"seq_len={seq_len} and local_batch_size={local_batch_size} must be positive")
    if split not in ("train", "validation"):
        raise ValueError(f"split={split!r} must be 'train' or 'validation'")


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
