"""One source of a weighted mixture (``data.sources``): its name, its weight and where its documents are.

A source has the fields a single source has in the ``data`` section (dataset, dataset_config, data_format,
text_field, splits, validation_files, token_store); data.shuffle, data.on_bad_record and the tokenizer are
the run's, shared by every source. In TOML each source is a table:

    [[data.sources]]
    name = "code"
    weight = 3
    dataset = "data/code-*.jsonl"
    validation_files = "data/code-val.jsonl"
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

from torchtitan_lite.components.data.sources import DataFormat


@dataclass(kw_only=True)
class MixtureSource:
    kind: ClassVar[str] = "source"
    """The one kind of entry data.sources holds (a TOML table may leave ``kind`` out)."""
    belongs_to: ClassVar[dict[str, str]] = {"dataset_config": "dataset"}

    name: str = ""
    """What the source is called in metrics (data/tokens/NAME, val/loss/NAME) and messages: letters,
    digits, '_', '-', '.' (required)."""
    weight: float = 1.0
    """Its share of the training tokens, relative to the other sources' weights (3 and 1: 75% and 25%)."""
    dataset: str = "embedded"
    """As data.dataset: 'embedded', a local file or glob, a local dataset folder, or a hub dataset name."""
    dataset_config: str | None = None
    """As data.dataset_config."""
    data_format: DataFormat = "auto"
    """As data.data_format."""
    text_field: str = "text"
    """As data.text_field."""
    train_split: str = "train"
    """As data.train_split."""
    validation_split: str = "validation"
    """As data.validation_split."""
    validation_files: str | None = None
    """As data.validation_files: this source's held-out documents."""
    token_store: str | None = None
    """As data.token_store: a folder scripts/pretokenize.py wrote for this source."""

    @classmethod
    def registry(cls) -> dict[str, type[MixtureSource]]:
        return {cls.kind: cls}

    def __post_init__(self) -> None:
        if not (isinstance(self.weight, int | float) and math.isfinite(self.weight) and self.weight > 0):
            raise ValueError(f"data.sources source {self.name!r} has weight={self.weight!r}; a weight is the source's "
                             f"share of the training tokens and must be a positive number: set it above 0, or "
                             f"remove the source from data.sources")
        if not self.dataset:
            raise ValueError(f"data.sources source {self.name!r} has an empty dataset; use 'embedded', a local "
                             f"path or glob, or a hub name")
        if not self.text_field:
            raise ValueError(f"data.sources source {self.name!r} has an empty text_field; name the field that "
                             f"holds the document text")
