"""The embedded default corpus: the running interpreter's own standard-library sources.

Every Python installation carries megabytes of real, varied text (code, docstrings, comments), so a
fresh machine can train and validate without downloading anything. Each ``*.py`` file is one
document ``{"text": <source>, "source": <path relative to the stdlib>}``. Test suites are left out
when the rest still reaches ``MIN_TRAIN_BYTES`` (it does on CPython 3.10+, ~11 MB); third-party
packages (site-packages) never enter.

The corpus is written once per interpreter version into ``<cache>/corpus/<key>/`` as JSON-lines
shards plus ``manifest.json``, and from then on it is read by ``datasets`` exactly like a user's
local files. The build is deterministic: documents are ordered and split by a hash of their relative
path, so every machine with the same interpreter produces byte-identical shards.
"""
from __future__ import annotations

import hashlib
import json
import os
import platform
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path

from torchtitan_lite.components.data.cache import build_once, cache_root

FORMAT_VERSION = 1
"""Bumped whenever the corpus recipe changes, so old caches are not reused."""

MIN_TRAIN_BYTES = 5_000_000
TRAIN_SHARDS = 4
VALIDATION_PERCENT = 2
_TEST_DIRS = frozenset({"test", "tests", "idle_test"})
_SKIP_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__"})


@dataclass(frozen=True)
class EmbeddedCorpus:
    """Where the materialised corpus lives and what it holds."""

    root: Path
    train_files: list[str]
    validation_files: list[str]
    train_bytes: int
    validation_bytes: int
    train_documents: int
    validation_documents: int
    includes_tests: bool

    def data_files(self, split: str) -> list[str]:
        """The JSON-lines shards of ``split`` ("train" or "validation")."""
        return {"train": self.train_files, "validation": self.validation_files}[split]


def corpus_key() -> str:
    """Cache key: implementation and full version, since the stdlib changes between patch releases."""
    return f"stdlib-{platform.python_implementation().lower()}-{platform.python_version()}-v{FORMAT_VERSION}"


def stdlib_dir() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def embedded_corpus() -> EmbeddedCorpus:
    """The embedded corpus, built into the cache on first use (safe under concurrent callers)."""
    root = build_once(cache_root() / "corpus" / corpus_key(), _write_corpus)
    manifest = json.loads((root / "manifest.json").read_text())
    return EmbeddedCorpus(
        root=root,
        train_files=[str(root / name) for name in manifest["train_files"]],
        validation_files=[str(root / name) for name in manifest["validation_files"]],
        train_bytes=manifest["train_bytes"],
        validation_bytes=manifest["validation_bytes"],
        train_documents=manifest["train_documents"],
        validation_documents=manifest["validation_documents"],
        includes_tests=manifest["includes_tests"],
    )


def _write_corpus(out: Path) -> None:
    documents = _read_stdlib(include_tests=False)
    includes_tests = _split_bytes(documents)[0] < MIN_TRAIN_BYTES
    if includes_tests:
        documents = _read_stdlib(include_tests=True)
    train_bytes, validation_bytes = _split_bytes(documents)
    if train_bytes < MIN_TRAIN_BYTES:
        raise RuntimeError(
            f"the standard library at {stdlib_dir()} holds only {train_bytes} bytes of Python source, "
            f"less than the {MIN_TRAIN_BYTES} the embedded corpus needs; this interpreter ships a "
            f"stripped stdlib, so point data.dataset at your own text files instead"
        )
    train = [d for d in documents if not _is_validation(d["source"])]
    validation = [d for d in documents if _is_validation(d["source"])]
    out.mkdir()
    train_names = [f"train-{i:05d}-of-{TRAIN_SHARDS:05d}.jsonl" for i in range(TRAIN_SHARDS)]
    for i, name in enumerate(train_names):
        _write_jsonl(out / name, train[i::TRAIN_SHARDS])
    validation_names = ["validation-00000-of-00001.jsonl"]
    _write_jsonl(out / validation_names[0], validation)
    manifest = {
        "python": sys.version,
        "stdlib": str(stdlib_dir()),
        "format_version": FORMAT_VERSION,
        "includes_tests": includes_tests,
        "train_files": train_names,
        "validation_files": validation_names,
        "train_bytes": train_bytes,
        "validation_bytes": validation_bytes,
        "train_documents": len(train),
        "validation_documents": len(validation),
    }
    (out / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")


def _read_stdlib(*, include_tests: bool) -> list[dict[str, str]]:
    """Every decodable ``*.py`` file as a document, ordered by a hash of its relative path.

    Hash order interleaves packages (asyncio next to email next to json), so any contiguous slice of
    the corpus, such as one data-parallel rank's shard, is a mix of topics rather than one package.
    """
    root = stdlib_dir()
    documents = []
    for dirpath, dirnames, filenames in os.walk(root):
        skip = _SKIP_DIRS if include_tests else _SKIP_DIRS | _TEST_DIRS
        dirnames[:] = sorted(d for d in dirnames if d not in skip)
        for name in sorted(filenames):
            if not name.endswith(".py"):
                continue
            path = Path(dirpath) / name
            try:
                text = path.read_bytes().decode("utf-8")
            except (OSError, UnicodeDecodeError):
                continue  # a few test fixtures are deliberately undecodable; they are not prose
            if not text.strip():
                continue  # empty __init__.py files would only add BOS EOS pairs
            documents.append({"text": text, "source": path.relative_to(root).as_posix()})
    documents.sort(key=lambda d: _path_hash(d["source"]))
    return documents


def _split_bytes(documents: list[dict[str, str]]) -> tuple[int, int]:
    train = sum(len(d["text"].encode("utf-8")) for d in documents if not _is_validation(d["source"]))
    total = sum(len(d["text"].encode("utf-8")) for d in documents)
    return train, total - train


def _path_hash(source: str) -> int:
    return int.from_bytes(hashlib.sha256(source.encode("utf-8")).digest()[:8], "big")


def _is_validation(source: str) -> bool:
    # A different slice of the hash than the ordering uses, so validation files are spread out.
    return (_path_hash(source) >> 7) % 100 < VALIDATION_PERCENT


def _write_jsonl(path: Path, documents: list[dict[str, str]]) -> None:
    with open(path, "w", encoding="utf-8") as out:
        for document in documents:
            out.write(json.dumps(document, ensure_ascii=False) + "\n")
