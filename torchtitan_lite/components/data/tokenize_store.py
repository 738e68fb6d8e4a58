"""Writing a token store (``token_store.py``) from any source the loader reads.

``write_store`` tokenises one split of a map-style source shard by shard: ``DOCS_PER_SHARD`` consecutive
documents per shard, in parallel processes when asked (``scripts/pretokenize.py --workers``), each shard's
files hashed as they are finished, ``index.json`` written last. ``cached_store`` is the same writer for a run
that names no store: the split is tokenised once into ``$TORCHTITAN_LITE_CACHE/tokens/<key>`` under the cache's
lock (the first rank builds, the others wait for it), keyed by the source's and the tokenizer's
fingerprints and the store version. So a pretokenised store and the on-the-fly one hold the same tokens,
and windows read from either are bitwise the same.

A document is tokenised exactly as the streaming loader does it: ``BOS tokens EOS`` in one batched call,
a document over ``LARGE_DOCUMENT_CHARS`` in line-aligned chunks (``chunked_encode.py``).
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import itertools
import json
import logging
import os
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from pathlib import Path
from typing import Any

import numpy as np
import xxhash

from torchtitan_lite.components.checkpoint.checksums import hash_file
from torchtitan_lite.components.data.cache import build_once, cache_root
from torchtitan_lite.components.data.chunked_encode import encode_large, is_large, specials
from torchtitan_lite.components.data.errors import DataSourceError
from torchtitan_lite.components.data.records import bad_record_error, log_skipped
from torchtitan_lite.components.data.sources import Role, load_split, local_files, source_kind
from torchtitan_lite.components.data.token_store import (
    INDEX_NAME,
    STORE_FORMAT,
    STORE_VERSION,
    TokenStore,
    open_store,
    shard_names,
    token_dtype,
)

DOCS_PER_SHARD = 8192
"""Documents per shard: the unit of parallel work. It does not change the stream, only how it is split."""
DOCS_PER_ENCODE = 256
"""Documents per batched tokenizer call."""
_PROBE = "A probe, to tell tokenizers apart: def f(x):\n    return x ** 2  # é 中 🙂"

logger = logging.getLogger(__name__)


def tokenizer_fingerprint(tokenizer: Any) -> tuple[str, str]:
    """(fingerprint, name) of a tokenizer: the hash of its model file with its vocabulary and document
    delimiters; a tokenizer without a file (a stand-in) by how it encodes a probe text."""
    digest = xxhash.xxh3_128()
    path = getattr(tokenizer, "path", None)
    if path is not None and os.path.isfile(path):
        digest.update(Path(path).read_bytes())
        name = str(path)
    else:
        digest.update(json.dumps(tokenizer.encode_batch([_PROBE])).encode())
        name = type(tokenizer).__qualname__
    digest.update(json.dumps([int(tokenizer.vocab_size), specials(tokenizer)]).encode())
    return digest.hexdigest()[:32], name


def source_fingerprint(cfg: Any, role: Role) -> str:
    """What identifies the documents of ``role``: local files by path, inode, size and modification time, the
    embedded corpus by its cache key, other sources by the fingerprint ``datasets`` gives their split."""
    from torchtitan_lite.components.data.corpus import corpus_key

    split = cfg.train_split if role == "train" else cfg.validation_split
    settings = [cfg.text_field, cfg.on_bad_record, cfg.data_format]
    if role == "validation" and cfg.validation_files is not None:
        what = ["files", _file_stamps(cfg.validation_files, cfg)]
    elif source_kind(cfg.dataset) == "embedded":
        what = ["embedded", corpus_key(), role]
    elif source_kind(cfg.dataset) == "files":
        what = ["files", _file_stamps(cfg.dataset, cfg)]
    else:
        documents = load_split(_map_style(cfg), role)
        what = [cfg.dataset, cfg.dataset_config, split, documents._fingerprint]
    return hashlib.sha256(json.dumps([what, settings]).encode()).hexdigest()[:32]


def cached_store(cfg: Any, role: Role, tokenizer: Any) -> TokenStore:
    """The store of ``role`` in the cache, written on first use (once per machine, under a lock)."""
    fingerprint, _ = tokenizer_fingerprint(tokenizer)
    key = hashlib.sha256(json.dumps([STORE_VERSION, source_fingerprint(cfg, role), fingerprint]).encode())
    target = cache_root() / "tokens" / key.hexdigest()[:32]
    if not target.exists():
        logger.info("tokenising split %r of data.dataset=%r into %s (once; scripts/pretokenize.py writes such a "
                    "store ahead of time)", role, cfg.dataset, target)
    return open_store(build_once(target, lambda out: write_store(out, cfg, role, tokenizer)), what=str(target))


def write_store(out: Path, cfg: Any, role: Role, tokenizer: Any, *, tokenizer_config: Any = None,
                workers: int = 1, progress: bool = False) -> None:
    """Tokenise split ``role`` of the source ``cfg`` describes into a new store folder ``out``. ``workers`` > 1
    tokenises shards in that many processes, each building its tokenizer from ``tokenizer_config``."""
    from tqdm import tqdm

    cfg = _map_style(cfg)
    documents = load_split(cfg, role)
    n = len(documents)
    dtype = token_dtype(int(tokenizer.vocab_size))
    ranges = [(a, min(a + DOCS_PER_SHARD, n)) for a in range(0, n, DOCS_PER_SHARD)]
    out.mkdir(parents=True)
    jobs = [(out, i, a, b, dtype.str) for i, (a, b) in enumerate(ranges)]
    bar = tqdm(total=n, unit="doc", desc=f"tokenising {role}", disable=not progress)
    shards: list[dict[str, Any]] = []
    skipped: Counter = Counter()
    if workers > 1 and len(jobs) > 1:
        if tokenizer_config is None:
            raise ValueError("write_store(workers > 1) needs tokenizer_config= to build the tokenizer in each process")
        # spawn: a forked copy of a process holding torch / tokenizer threads can deadlock.
        with ProcessPoolExecutor(min(workers, len(jobs)), mp_context=get_context("spawn")) as pool:
            results = pool.map(_write_shard_in_worker, [(cfg, role, tokenizer_config, *job) for job in jobs])
            for shard, bad in results:
                shards.append(shard)
                skipped.update(bad)
                bar.update(shard["rows"][1] - shard["rows"][0])
    else:
        for job in jobs:
            shard, bad = _write_shard(documents, cfg, role, tokenizer, *job)
            shards.append(shard)
            skipped.update(bad)
            bar.update(shard["rows"][1] - shard["rows"][0])
    bar.close()
    if skipped:
        log_skipped(sum(skipped.values()), skipped, f"split {role!r} of data.dataset={cfg.dataset!r}", [])
    fingerprint, name = tokenizer_fingerprint(tokenizer)
    bos, eos = specials(tokenizer)
    index = {
        "format": STORE_FORMAT, "version": STORE_VERSION, "dtype": dtype.str, "vocab_size": int(tokenizer.vocab_size),
        "tokenizer": {"fingerprint": fingerprint, "name": name, "bos": bos, "eos": eos},
        "source": _describe_source(cfg, role, n, skipped),
        "n_tokens": sum(s["n_tokens"] for s in shards), "n_documents": sum(s["n_documents"] for s in shards),
        "shards": shards,
    }
    # Written last: a folder without its index is not a store (a killed write leaves nothing usable).
    (out / INDEX_NAME).write_text(json.dumps(index, indent=1) + "\n")


def _map_style(cfg: Any) -> Any:
    """The store reads a source map-style, whatever the run's order (a store is in source order)."""
    return dataclasses.replace(cfg, streaming=False, shuffle="none")


def _describe_source(cfg: Any, role: Role, n_records: int, skipped: Counter) -> dict[str, Any]:
    split = cfg.train_split if role == "train" else cfg.validation_split
    files = cfg.validation_files if role == "validation" and cfg.validation_files is not None else \
        cfg.dataset if source_kind(cfg.dataset) == "files" else None
    return {
        "dataset": cfg.dataset, "dataset_config": cfg.dataset_config, "split": split, "role": role,
        "files": None if files is None else [{"path": p, "size": s} for p, _, s, _ in _file_stamps(files, cfg)],
        "text_field": cfg.text_field, "on_bad_record": cfg.on_bad_record, "n_records": n_records,
        "skipped_records": dict(skipped), "fingerprint": source_fingerprint(cfg, role),
    }


def _file_stamps(pattern: str, cfg: Any) -> list[tuple[str, int, int, int]]:
    files, _, _ = local_files(pattern, cfg, f"data files {pattern!r}")
    return [(os.path.abspath(f), (st := os.stat(f)).st_ino, st.st_size, st.st_mtime_ns) for f in files]


def _write_shard_in_worker(job: tuple) -> tuple[dict[str, Any], Counter]:
    cfg, role, tokenizer_config, *rest = job
    return _write_shard(load_split(cfg, role), cfg, role, tokenizer_config.build(), *rest)


def _write_shard(documents: Any, cfg: Any, role: Role, tokenizer: Any, out: Path, i: int, start: int, stop: int,
                 dtype_str: str) -> tuple[dict[str, Any], Counter]:
    """Shard ``i``: documents ``[start, stop)`` of the split. Returns its index entry and the bad records
    skipped in it."""
    dtype = np.dtype(dtype_str)
    limit = np.iinfo(dtype).max
    tokens_name, starts_name = shard_names(i)
    skipped: Counter = Counter()
    starts: list[int] = []
    n_tokens, largest = 0, -1
    with open(out / tokens_name, "wb") as f:
        for a in range(start, stop, DOCS_PER_ENCODE):
            b = min(a + DOCS_PER_ENCODE, stop)
            values = documents[a:b][cfg.text_field]
            texts = [_text(v, functools.partial(_row_name, cfg, role, row), cfg, skipped)
                     for row, v in zip(range(a, b), values, strict=True)]
            token_lists = _encode([t for t in texts if t is not None], tokenizer)
            for tokens in token_lists:
                starts.append(n_tokens)
                n_tokens += len(tokens)
            total = sum(map(len, token_lists))
            block = np.fromiter(itertools.chain.from_iterable(token_lists), dtype=np.int64, count=total)
            if total:
                largest = max(largest, int(block.max()))
            if largest > limit:
                raise DataSourceError(f"the tokenizer gave id {largest}, more than {dtype} holds; its vocab_size "
                                      f"({tokenizer.vocab_size}) is wrong")
            block.astype(dtype).tofile(f)
    np.asarray(starts, dtype="<i8").tofile(out / starts_name)
    entry = {
        "tokens": tokens_name, "starts": starts_name, "rows": [start, stop], "n_tokens": n_tokens,
        "n_documents": len(starts), "max_id": largest,
        "checksums": {"tokens": hash_file(str(out / tokens_name))["hash"],
                      "starts": hash_file(str(out / starts_name))["hash"]},
    }
    return entry, skipped


def _encode(texts: list[str], tokenizer: Any) -> list[list[int]]:
    """Token lists of ``texts`` in order: the small ones in one batched call, a large one in chunks."""
    small = [i for i, t in enumerate(texts) if not is_large(t)]
    encoded = dict(zip(small, tokenizer.encode_batch([texts[i] for i in small]) if small else [], strict=True))
    for i, text in enumerate(texts):
        if i not in encoded:
            encoded[i] = [t for pieces, _ in encode_large(tokenizer, text) for piece in pieces for t in piece]
    return [encoded[i] for i in range(len(texts))]


def _text(value: Any, name: Callable[[], str], cfg: Any, skipped: Counter) -> str | None:
    """``value`` when it is a document; a bad record is an error, or None (counted) with on_bad_record=skip.
    (Local files were scanned before loading; this catches the sources that are not.)"""
    if isinstance(value, str):
        return value
    field = cfg.text_field
    reason, detail = ("null value", f"has {field}=None (null), not a string") if value is None else \
        ("non-string value", f"has {field}={value!r} ({type(value).__name__}), not a string")
    if cfg.on_bad_record == "error":
        raise bad_record_error(f"{name()} {detail}", reason)
    skipped[reason] += 1
    return None


def _row_name(cfg: Any, role: Role, row: int) -> str:
    split = cfg.train_split if role == "train" else cfg.validation_split
    return f"row {row} of split {split!r} of data.dataset={cfg.dataset!r}"
