"""The text data loader's settings, and which loader a source gets.

A random-access source (the embedded corpus, local files, dataset folders, map-style hub splits) is read
from a token store (``token_store.py``): the one ``data.token_store`` names (written by
``scripts/pretokenize.py``), or one written into the cache on first use. Its windows are read in one global
order, step ``s`` taking the next global batch of it and each data-parallel rank a stride
(``window_loader.py``, ``windows.py``). A stream (``data.streaming``) is tokenised as it is read, each rank
reading its own shards (``stream_loader.py``).

Both hand out ``Batch`` es (``batch.py``): ``(inputs, labels)`` LongTensors [B, S] with each row's document
starts, and checkpoint a state that loads with ``torch.load(weights_only=True)``.

``data.sources`` makes the run read a weighted mixture of random-access sources (``mixture_loader.py``):
each source its own store and window order, interleaved by weight (``mixture.py``).
"""
from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

from torchtitan_lite.components.data.mixture_source import MixtureSource
from torchtitan_lite.components.data.sources import DataFormat
from torchtitan_lite.components.data.windows import SHUFFLE_MODES, ShuffleMode
from torchtitan_lite.config import Configurable

_SOURCE_NAME = re.compile(r"[A-Za-z0-9_.-]+")


class TextDataLoader(Configurable):
    """Batches of packed token windows; ``Config.build`` returns a ``WindowLoader`` for a random-access
    source and a ``StreamLoader`` for a stream."""

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
        token_store: str | None = None
        """Folder written by scripts/pretokenize.py: training reads its train/ store (and validation its
        validation/ store) instead of tokenising the source; its tokenizer must be the run's. None
        tokenises the source into a store in the cache on first use (the same bytes)."""
        streaming: bool = False
        """Read the source as a streaming IterableDataset (no Arrow cache, no full download first),
        tokenised as it is read."""
        shuffle_buffer: int = 0
        """Streams only: windows held in a bounded shuffle buffer (seeded, exactly resumable): each window
        the stream produces replaces one drawn at random from it, so a batch mixes windows from a span of
        this many. 0 reads the stream's windows in order. Costs shuffle_buffer x (seq_len + 1) x 4 bytes of
        memory and checkpoint per data-parallel rank. Random-access sources shuffle globally instead
        (data.shuffle=windows)."""
        shuffle: ShuffleMode = "windows"
        """Training order, seeded by training.seed and the epoch, exactly resumable on any layout:
        'windows' reads the seq_len+1 windows of each epoch in a random permutation (a batch mixes the
        whole corpus); 'documents' shuffles the documents, then reads the windows of that stream in
        order; 'none' reads the source order. Streams (data.streaming) need 'none'. Validation always
        reads the source order. (This was a bool: true read what 'documents' reads, false 'none'.)"""
        on_bad_record: Literal["error", "skip"] = "error"
        """A bad record: in local JSON-lines, JSON, text, CSV or Parquet files, compressed or not (invalid
        UTF-8 or JSON, missing field or column, null or non-string value, malformed CSV row), found
        before training; in other sources (hub, dataset folders, streams) a record whose text field is
        missing or not a string, found when read. 'error' stops naming file and line or row (dataset,
        shard and record); 'skip' leaves such records out, logging how many per reason (the remaining
        documents resume exactly like any other source)."""

        sources: list[MixtureSource] = field(default_factory=list)
        """A weighted mixture: several sources, each with a name, a weight (its share of the training
        tokens) and the fields of one source (dataset, dataset_config, data_format, text_field, splits,
        validation_files, token_store), e.g. TOML [[data.sources]] tables. data.shuffle and
        data.on_bad_record apply to every source; data.dataset and the other single-source fields are not
        read. Empty: the single source data.dataset."""

        def __post_init__(self) -> None:
            self._check_sources()
            if not self.dataset:
                raise ValueError("data.dataset is empty; use 'embedded', a local path or glob, or a hub name")
            if not self.text_field:
                raise ValueError("data.text_field is empty; name the field that holds the document text")
            if isinstance(self.shuffle, bool) or self.shuffle not in SHUFFLE_MODES:
                old = {True: " (true read the documents in a shuffled order: 'documents'; 'windows' mixes "
                             "more)", False: " (false: 'none')"}.get(self.shuffle, "")  # type: ignore[call-overload]
                raise ValueError(f"data.shuffle={self.shuffle!r} is not an order; use one of "
                                 f"{', '.join(SHUFFLE_MODES)}{old}")
            if self.streaming and self.shuffle != "none":
                raise ValueError(f"data.shuffle={self.shuffle!r} needs a random-access source, but "
                                 f"data.streaming=true; a stream is read in its stable shard order so that it resumes "
                                 f"exactly: set data.shuffle=none (or data.streaming=false)")
            if self.shuffle_buffer < 0:
                raise ValueError(f"data.shuffle_buffer={self.shuffle_buffer} is negative; give a number of windows, "
                                 f"or 0 for none")
            if self.shuffle_buffer and not self.streaming:
                raise ValueError(f"data.shuffle_buffer={self.shuffle_buffer} shuffles a stream's windows, but "
                                 f"data.streaming=false: a random-access source is shuffled globally "
                                 f"(data.shuffle=windows). Set data.shuffle_buffer=0, or data.streaming=true")
            if self.streaming and self.token_store is not None:
                raise ValueError("data.token_store is read by random access, data.streaming=true streams the source; "
                                 "unset one of them")

        def _check_sources(self) -> None:
            for i, source in enumerate(self.sources):
                if not _SOURCE_NAME.fullmatch(source.name):
                    raise ValueError(f"data.sources.{i} (dataset={source.dataset!r}) has name={source.name!r}; give "
                                     f"it a name of letters, digits, '_', '-' or '.' (it names the source's metrics)")
            names = [source.name for source in self.sources]
            if twice := sorted({n for n in names if names.count(n) > 1}):
                raise ValueError(f"data.sources names {', '.join(map(repr, twice))} more than once; every source "
                                 f"needs its own name (it names its metrics and its place in a checkpoint)")
            if self.sources and self.streaming:
                raise ValueError("data.sources mixes random-access sources (each read from its token store); a mixture "
                                 "of streams is not supported: set data.streaming=false, or train on one stream "
                                 "(data.dataset, with data.sources empty)")
            if self.sources and self.token_store is not None:
                raise ValueError("data.token_store names one source's store, but data.sources lists the sources: set "
                                 "token_store in each source's table (data.sources.N.token_store) and unset "
                                 "data.token_store")

        def source_config(self, index: int) -> TextDataLoader.Config:
            """Source ``index`` of data.sources as a single-source data config (the run's shared settings)."""
            source = self.sources[index]
            return dataclasses.replace(
                self, sources=[], dataset=source.dataset, dataset_config=source.dataset_config,
                data_format=source.data_format, text_field=source.text_field, train_split=source.train_split,
                validation_split=source.validation_split, validation_files=source.validation_files,
                token_store=source.token_store)

        def describe_source(self) -> str:
            """What the run reads, for a checkpoint's data layout: data.dataset, or the mixture's sources."""
            if not self.sources:
                return self.dataset
            return "mixture " + ", ".join(f"{s.name}={s.dataset} x{s.weight:g}" for s in self.sources)

        def build(self, **runtime: Any) -> Any:
            if self.sources:
                from torchtitan_lite.components.data.mixture_loader import MixtureLoader

                return MixtureLoader(self, **runtime)
            if self.streaming:
                from torchtitan_lite.components.data.stream_loader import StreamLoader

                return StreamLoader(self, **runtime)
            from torchtitan_lite.components.data.window_loader import WindowLoader

            return WindowLoader(self, **runtime)
