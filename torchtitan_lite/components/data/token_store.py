"""The token store: one split of one source, tokenised once, in memory-mapped files.

Every document is ``BOS tokens EOS``; the documents are laid end to end in source order (the very stream
the packer cuts into ``seq_len + 1`` windows) and split into shards of whole documents. A store folder:

    index.json             format version, token dtype, vocabulary, tokenizer fingerprint, source, shards
    shard-00000.tokens     the shard's token ids, raw little-endian uint16 (vocabulary <= 65536) or uint32
    shard-00000.starts     int64 offset of each of its documents' first token (the BOS) in the shard

``index.json`` gives each shard its token and document counts, its largest token id and the xxh3_128 hash
of both files (the checkpoint's hash, ``checksums.py``). ``open_store`` checks the format and that every
file is there with its size (cheap); ``verify`` reads every byte once: the checksums, and the largest id
against the model's vocabulary. ``scripts/pretokenize.py`` writes stores; a run without one writes its own
into the cache (``tokenize_store.py``), so both read the same bytes.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np

from torchtitan_lite.components.checkpoint.checksums import ALGORITHM, hash_file
from torchtitan_lite.components.data.errors import DataSourceError

STORE_FORMAT = "torchtitan_lite.token_store"
STORE_VERSION = 1
"""Bumped whenever the layout or the tokenisation recipe changes: an older store is refused (and the
cache builds a new one)."""
INDEX_NAME = "index.json"
REWRITE_HINT = "re-run scripts/pretokenize.py to write it again"


class TokenStoreError(DataSourceError):
    """A token store that cannot be read as it is; the message names the file and the fix."""


def token_dtype(vocab_size: int) -> np.dtype:
    """The smallest unsigned dtype that holds every id of a ``vocab_size`` vocabulary."""
    return np.dtype("<u2") if vocab_size <= 1 << 16 else np.dtype("<u4")


def shard_names(i: int) -> tuple[str, str]:
    return f"shard-{i:05d}.tokens", f"shard-{i:05d}.starts"


@dataclass(frozen=True)
class TokenStore:
    """A read-only store: ``tokens(a, b)`` is ``[a, b)`` of the concatenated stream, ``doc_starts`` the
    stream offset of every document's BOS."""

    folder: Path
    index: dict[str, Any]

    @property
    def n_tokens(self) -> int:
        return int(self.index["n_tokens"])

    @property
    def n_documents(self) -> int:
        return int(self.index["n_documents"])

    @property
    def tokenizer(self) -> dict[str, Any]:
        return self.index["tokenizer"]

    @property
    def identity(self) -> str:
        """What a data position is valid for: the same tokens in the same order, however they were written
        (pretokenised or in the cache) and wherever the folder lies."""
        return f"{self.index['source']['fingerprint']}-{self.tokenizer['fingerprint']}-{self.n_tokens}"

    @cached_property
    def _shards(self) -> list[np.ndarray]:
        dtype = np.dtype(self.index["dtype"])
        # An empty shard cannot be memory-mapped; it holds no tokens to read anyway.
        return [np.memmap(self.folder / s["tokens"], dtype=dtype, mode="r") if s["n_tokens"] else
                np.empty(0, dtype) for s in self.index["shards"]]

    @cached_property
    def _shard_offsets(self) -> np.ndarray:
        return np.concatenate([[0], np.cumsum([s["n_tokens"] for s in self.index["shards"]])]).astype(np.int64)

    @cached_property
    def doc_starts(self) -> np.ndarray:
        """int64 [n_documents]: each document's first token in the stream, ascending."""
        parts = [np.fromfile(self.folder / s["starts"], dtype="<i8") + offset
                 for s, offset in zip(self.index["shards"], self._shard_offsets[:-1], strict=True)]
        return np.concatenate(parts) if parts else np.empty(0, np.int64)

    def tokens(self, start: int, stop: int) -> np.ndarray:
        """Stream tokens ``[start, stop)`` (across shard boundaries), as they are stored."""
        offsets = self._shard_offsets
        first = int(np.searchsorted(offsets, start, side="right")) - 1
        pieces = []
        while start < stop:
            shard_start, shard_stop = int(offsets[first]), int(offsets[first + 1])
            end = min(stop, shard_stop)
            pieces.append(self._shards[first][start - shard_start:end - shard_start])
            start, first = end, first + 1
        return pieces[0] if len(pieces) == 1 else np.concatenate(pieces)

    def verify(self, *, vocab_size: int) -> None:
        """Read every file once: its checksum, and no token id at or beyond ``vocab_size`` (the model's)."""
        for shard in self.index["shards"]:
            for key in ("tokens", "starts"):
                digest = hash_file(str(self.folder / shard[key]))
                if digest["hash"] != shard["checksums"][key]:
                    raise TokenStoreError(
                        f"{self.folder / shard[key]} does not match its {ALGORITHM} checksum in {INDEX_NAME}: it "
                        f"changed since it was written (a partial copy, a disk error); {REWRITE_HINT}")
        for shard, tokens in zip(self.index["shards"], self._shards, strict=True):
            # Read from the data, not the index: the index could agree with corrupted tokens.
            largest = int(tokens.max()) if len(tokens) else -1
            if largest >= vocab_size:
                raise TokenStoreError(
                    f"{self.folder / shard['tokens']} holds token id {largest}, beyond the model's vocabulary of "
                    f"{vocab_size} ids (0..{vocab_size - 1}), so the embedding has no row for it; write the store with "
                    f"the run's tokenizer (scripts/pretokenize.py --tokenizer PATH), or train with a tokenizer whose "
                    f"vocabulary covers it")

    def check_tokenizer(self, fingerprint: str, name: str) -> None:
        """Refuse a store written by another tokenizer: its ids mean other pieces."""
        written = self.tokenizer
        if written["fingerprint"] != fingerprint:
            raise TokenStoreError(
                f"{self.folder / INDEX_NAME} was written with tokenizer {written['name']} (fingerprint "
                f"{written['fingerprint']}), this run tokenises with {name} (fingerprint {fingerprint}): its ids "
                f"would mean other pieces. Pretokenise the data again with this run's tokenizer "
                f"(scripts/pretokenize.py --tokenizer ...), or set tokenizer.path to the one the store was written with")


def open_store(folder: str | os.PathLike, what: str = "data.token_store", output: str | None = None) -> TokenStore:
    """The store in ``folder``, its index read and every file checked for presence and size (no data read).
    ``output``: the --output of scripts/pretokenize.py that writes it (default: ``folder``)."""
    folder = Path(folder).expanduser()
    index_path = folder / INDEX_NAME
    if not index_path.is_file():
        raise TokenStoreError(f"{what}: {index_path} does not exist, so {folder} is not a token store; write one "
                              f"with scripts/pretokenize.py --output {output or folder}")
    try:
        index = json.loads(index_path.read_text())
    except (OSError, ValueError) as error:
        raise TokenStoreError(f"{what}: {index_path} is not readable JSON ({error}); {REWRITE_HINT}") from None
    if not isinstance(index, dict) or index.get("format") != STORE_FORMAT or index.get("version") != STORE_VERSION:
        found = (index.get("format"), index.get("version")) if isinstance(index, dict) else None
        raise TokenStoreError(f"{what}: {index_path} is not a token store of version {STORE_VERSION} (found "
                              f"{found}); {REWRITE_HINT}")
    itemsize = np.dtype(index["dtype"]).itemsize
    for shard in index["shards"]:
        for key, size in (("tokens", shard["n_tokens"] * itemsize), ("starts", shard["n_documents"] * 8)):
            path = folder / shard[key]
            if not path.is_file():
                raise TokenStoreError(f"{what}: {path} is missing; {REWRITE_HINT}")
            if path.stat().st_size != size:
                raise TokenStoreError(f"{what}: {path} has {path.stat().st_size} bytes, {INDEX_NAME} says {size}; "
                                      f"{REWRITE_HINT}")
    return TokenStore(folder, index)
