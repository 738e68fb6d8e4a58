import json
import multiprocessing as mp
import os
import time
from pathlib import Path

import pytest

from torchtitan_lite.components.data import cache
from torchtitan_lite.components.data.corpus import (
    MIN_TRAIN_BYTES,
    TRAIN_SHARDS,
    _is_validation,
    _read_stdlib,
    corpus_key,
    embedded_corpus,
)


@pytest.fixture(scope="module")
def corpus():
    return embedded_corpus()


def _documents(files):
    return [json.loads(line) for f in files for line in open(f, encoding="utf-8")]


def test_train_split_holds_at_least_5_mb_of_real_text(corpus):
    assert corpus.train_bytes >= MIN_TRAIN_BYTES
    train = _documents(corpus.train_files)
    assert sum(len(d["text"].encode("utf-8")) for d in train) == corpus.train_bytes
    assert len(train) == corpus.train_documents and len(corpus.train_files) == TRAIN_SHARDS
    assert any(d["source"] == "json/decoder.py" for d in train + _documents(corpus.validation_files))
    assert all(set(d) == {"text", "source"} and d["text"] for d in train)


def test_split_is_disjoint_and_decided_by_the_path_hash(corpus):
    train = {d["source"] for d in _documents(corpus.train_files)}
    validation = {d["source"] for d in _documents(corpus.validation_files)}
    assert not train & validation
    assert len(validation) == corpus.validation_documents > 0
    assert all(_is_validation(s) for s in validation) and not any(_is_validation(s) for s in train)
    # ~2% of files: loose bounds, the hash decides per file.
    assert 0.005 < len(validation) / (len(train) + len(validation)) < 0.05


def test_test_suites_and_site_packages_are_left_out(corpus):
    sources = [d["source"] for d in _documents(corpus.train_files + corpus.validation_files)]
    parts = {p for s in sources for p in s.split("/")[:-1]}
    assert not corpus.includes_tests
    assert not parts & {"test", "tests", "idle_test", "site-packages"}


def test_build_is_deterministic(corpus, tmp_path, monkeypatch):
    monkeypatch.setenv(cache.CACHE_ENV, str(tmp_path))
    rebuilt = embedded_corpus()
    assert rebuilt.root == tmp_path / "corpus" / corpus_key()
    for a, b in zip(corpus.train_files + corpus.validation_files, rebuilt.train_files + rebuilt.validation_files):
        assert Path(a).read_bytes() == Path(b).read_bytes()
    assert not [p for p in (tmp_path / "corpus").iterdir() if p.name.startswith(".") and p.is_dir()]


def test_documents_are_ordered_by_path_hash_not_by_package():
    documents = _read_stdlib(include_tests=False)
    first_packages = {d["source"].split("/")[0] for d in documents[:50]}
    assert len(first_packages) > 20


def _build_slowly(target: str, log: str) -> None:
    def build(out: Path) -> None:
        with open(log, "a") as f:
            f.write("built\n")
        time.sleep(0.3)  # long enough that the other process waits on the lock
        out.write_text("done")

    cache.build_once(Path(target), build)
    assert Path(target).read_text() == "done"


def test_build_once_builds_one_time_under_concurrency(tmp_path):
    target, log = tmp_path / "artefact", tmp_path / "log"
    ctx = mp.get_context("fork")
    procs = [ctx.Process(target=_build_slowly, args=(str(target), str(log))) for _ in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=30)
    assert [p.exitcode for p in procs] == [0, 0]
    assert log.read_text() == "built\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == [".artefact.lock", "artefact", "log"]


def test_failed_build_leaves_nothing_behind(tmp_path):
    def broken(out: Path) -> None:
        out.write_text("half")
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError, match="disk full"):
        cache.build_once(tmp_path / "artefact", broken)
    assert sorted(p.name for p in tmp_path.iterdir()) == [".artefact.lock"]


def test_cache_root_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv(cache.CACHE_ENV, str(tmp_path / "c"))
    assert cache.cache_root() == tmp_path / "c"
    monkeypatch.delenv(cache.CACHE_ENV)
    assert cache.cache_root() == Path(os.path.expanduser("~")) / ".cache" / "torchtitan_lite"
