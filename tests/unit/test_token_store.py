"""The token store: what scripts/pretokenize.py writes, that a run reads the same windows from it as from the
store it writes into its cache, and the stores it refuses before training."""
import json
import os
from concurrent.futures import ThreadPoolExecutor

import datasets
import numpy as np
import pytest
import torch
from _char_tokenizer import BOS, EOS, CharTokenizer

from torchtitan_lite.components.checkpoint.checksums import hash_file
from torchtitan_lite.components.data import TextDataLoader, tokenize_store
from torchtitan_lite.components.data.token_store import TokenStore, TokenStoreError, open_store
from torchtitan_lite.components.data.tokenize_store import write_store
from torchtitan_lite.tools import pretokenize


class WideTokenizer(CharTokenizer):
    """Ids beyond 65,535: the store needs uint32."""

    vocab_size = 70_000

    def encode_batch(self, texts, bos=True, eos=True):
        return [[BOS] * bos + [ord(c) + 65_000 for c in t] + [EOS] * eos for t in texts]


@pytest.fixture(autouse=True)
def isolated_hf_cache(tmp_path, monkeypatch):
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hf-cache"))


@pytest.fixture
def docs_file(tmp_path):
    docs = [f"document {i}: " + "xyz"[i % 3] * (i % 17) for i in range(40)]
    path = tmp_path / "docs.jsonl"
    path.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    return path, docs


def _write(tmp_path, path, tokenizer, name="store"):
    out = tmp_path / name / "train"
    write_store(out, TextDataLoader.Config(dataset=str(path)), "train", tokenizer)
    return out


def _build(cfg, tokenizer, **kw):
    return cfg.build(tokenizer=tokenizer, dp_rank=0, dp_world_size=1, seq_len=15, local_batch_size=4, seed=0, **kw)


def test_a_store_holds_the_packing_stream_its_starts_and_checksums(tmp_path, docs_file):
    path, docs = docs_file
    out = _write(tmp_path, path, CharTokenizer())
    store = open_store(out)
    expected = [t for ids in CharTokenizer().encode_batch(docs) for t in ids]
    assert store.index["dtype"] == "<u2" and store.n_documents == 40 and store.n_tokens == len(expected)
    assert store.tokens(0, store.n_tokens).tolist() == expected
    assert store.tokens(5, 9).tolist() == expected[5:9]
    lengths = [len(d) + 2 for d in docs]
    assert store.doc_starts.tolist() == np.concatenate([[0], np.cumsum(lengths)[:-1]]).tolist()
    shard = store.index["shards"][0]
    assert shard["max_id"] == max(expected) and shard["checksums"]["tokens"] == hash_file(str(out / shard["tokens"]))["hash"]
    assert store.index["source"]["files"][0]["path"] == str(path) and store.index["source"]["n_records"] == 40


def test_a_vocabulary_over_65536_ids_is_stored_as_uint32(tmp_path, docs_file):
    path, docs = docs_file
    store = open_store(_write(tmp_path, path, WideTokenizer()))
    assert store.index["dtype"] == "<u4"
    assert store.tokens(0, 20).tolist() == [t for ids in WideTokenizer().encode_batch(docs) for t in ids][:20]


class _ThreadPool(ThreadPoolExecutor):
    def __init__(self, workers, mp_context=None):
        super().__init__(workers)


def test_pretokenized_and_on_the_fly_windows_are_bitwise_identical(tmp_path, docs_file, monkeypatch):
    from torchtitan_lite.components.tokenizer import Tokenizer

    path, _ = docs_file
    tokenizer = Tokenizer.Config().build()
    on_the_fly = _build(TextDataLoader.Config(dataset=str(path), validation_files=str(path)), tokenizer)
    # Shards of 7 documents tokenised by 2 workers: another layout of the files, the same stream. The workers are
    # threads standing in for the processes (each still builds its own tokenizer and dataset from the configs):
    # a spawned process would spend seconds importing torch.
    monkeypatch.setattr(tokenize_store, "DOCS_PER_SHARD", 7)
    monkeypatch.setattr(tokenize_store, "ProcessPoolExecutor", _ThreadPool)
    assert pretokenize.main(["--dataset", str(path), "--output", str(tmp_path / "tokens"), "--workers", "2"]) == 0
    stored = _build(TextDataLoader.Config(dataset=str(path), token_store=str(tmp_path / "tokens")), tokenizer)
    assert len(stored.store.index["shards"]) == 6 and len(on_the_fly.store.index["shards"]) == 1
    assert stored.store.identity == on_the_fly.store.identity  # so a position saved by one resumes on the other
    a, b = iter(on_the_fly), iter(stored)
    for _ in range(12):
        x, y = next(a), next(b)
        assert torch.equal(x[0], y[0]) and torch.equal(x[1], y[1])
        assert all(torch.equal(s, t) for s, t in zip(x.doc_starts, y.doc_starts, strict=True))
    # A file source has no validation split: only train/ was written, and validation says so.
    assert not (tmp_path / "tokens" / "validation").exists()
    with pytest.raises(TokenStoreError, match=r"has no validation/ store .* --validation.enable false"):
        _build(TextDataLoader.Config(dataset=str(path), token_store=str(tmp_path / "tokens")), tokenizer,
               split="validation", infinite=False)


# --------------------------------------------------------------------------------------------------
# Refusals (the run-level tests check that the dump folder does not change: test_refused_run_changes_nothing.py)


def _stored(tmp_path, docs_file):
    out = _write(tmp_path, docs_file[0], CharTokenizer())
    return out, TextDataLoader.Config(dataset=str(docs_file[0]), token_store=str(out.parent))


def test_a_shard_that_changed_is_refused_naming_the_file(tmp_path, docs_file):
    out, cfg = _stored(tmp_path, docs_file)
    tokens = out / "shard-00000.tokens"
    data = bytearray(tokens.read_bytes())
    data[100] ^= 1
    tokens.write_bytes(bytes(data))
    with pytest.raises(TokenStoreError, match=rf"{tokens} does not match its xxh3_128 checksum in index.json.*"
                                              r"re-run scripts/pretokenize.py"):
        _build(cfg, CharTokenizer())


def test_a_store_is_read_through_once_per_machine_until_a_file_changes(tmp_path, docs_file, monkeypatch):
    out, cfg = _stored(tmp_path, docs_file)
    calls = []
    verify = TokenStore.verify
    monkeypatch.setattr(TokenStore, "verify", lambda self, **kw: (calls.append(kw), verify(self, **kw))[1])
    for _ in range(2):  # a second loader (another rank, a validation pass, the next run) finds it verified
        _build(cfg, CharTokenizer())
    assert len(calls) == 1
    _build(cfg, CharTokenizer(), vocab_size=190)  # another model vocabulary is another check
    tokens = out / "shard-00000.tokens"
    data = bytearray(tokens.read_bytes())
    data[3] ^= 1
    tokens.write_bytes(bytes(data))  # same size and inode, a new modification time
    with pytest.raises(TokenStoreError, match="does not match its xxh3_128 checksum"):
        _build(cfg, CharTokenizer())
    assert len(calls) == 3


def test_a_token_id_beyond_the_models_vocabulary_is_refused_naming_shard_and_id(tmp_path, docs_file):
    out, cfg = _stored(tmp_path, docs_file)
    largest = open_store(out).index["shards"][0]["max_id"]
    # The tokenizer says 200 ids; a model of exactly `largest` ids has no row for the largest one.
    with pytest.raises(TokenStoreError, match=rf"shard-00000.tokens holds token id {largest}, beyond the model's "
                                              rf"vocabulary of {largest} ids"):
        _build(cfg, CharTokenizer(), vocab_size=largest)
    _build(cfg, CharTokenizer(), vocab_size=largest + 1)


def test_a_store_of_another_tokenizer_is_refused_naming_both(tmp_path, docs_file):
    out, cfg = _stored(tmp_path, docs_file)
    with pytest.raises(TokenStoreError, match=r"written with tokenizer CharTokenizer \(fingerprint [0-9a-f]+\), this run "
                                              r"tokenises with WideTokenizer \(fingerprint [0-9a-f]+\).*scripts/pretokenize"):
        _build(cfg, WideTokenizer())


@pytest.mark.parametrize("missing", ["shard-00000.starts", "index.json"])
def test_a_missing_store_file_is_refused_by_name(tmp_path, docs_file, missing):
    out, cfg = _stored(tmp_path, docs_file)
    os.remove(out / missing)
    hint = r"re-run scripts/pretokenize.py" if missing != "index.json" else \
        rf"write one with scripts/pretokenize.py --output {out.parent}$"
    with pytest.raises(TokenStoreError, match=rf"{out / missing} (is missing|does not exist).*{hint}"):
        _build(cfg, CharTokenizer())
