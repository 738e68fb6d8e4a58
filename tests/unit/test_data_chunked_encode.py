"""Large documents are tokenised in line-aligned chunks, framed by one BOS and one EOS, and streamed:
their windows come out as their chunks are tokenised, equal to those of tokenising them whole first,
and a loader stopped inside one resumes exactly."""
from __future__ import annotations

import itertools
import json

import numpy as np
import pytest
import torch
from test_data_loader import (  # noqa: F401  (isolated_hf_cache: an autouse fixture)
    BOS,
    EOS,
    CharTokenizer,
    _build,
    _roundtrip,
    _take,
    isolated_hf_cache,
)

from torchtitan_lite.components.data import TextDataLoader, chunked_encode
from torchtitan_lite.components.data.chunked_encode import encode_large, split_text
from torchtitan_lite.components.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def tokenizer():
    return Tokenizer.Config().build()


def _flat(pieces) -> list[int]:
    return [t for tokens, _ in pieces for t in itertools.chain.from_iterable(tokens)]


def test_split_prefers_line_breaks_then_spaces_and_loses_nothing():
    text = "aaaa\nbbbbbbbb cc\n" + "x" * 25
    pieces = split_text(text, chunk_chars=10)
    assert "".join(pieces) == text
    assert pieces[0] == "aaaa\n" and pieces[1] == "bbbbbbbb " and all(len(p) <= 10 for p in pieces)


def test_pieces_grow_and_resume_at_any_chunk_boundary():
    tok = CharTokenizer()
    text = "line one\n" * 200  # 200 chunks of 9 characters
    pieces = list(encode_large(tok, text, chunk_chars=16, max_chunks=8))
    assert _flat(pieces) == tok.encode_batch([text])[0]  # a context-free tokenizer: exactly the whole encoding
    assert [len(tokens) for tokens, _ in pieces][:5] == [2, 2, 4, 8, 8]  # BOS + 1 chunk, 2, 4, then the cap
    assert pieces[-1][0][-1] == [EOS] and pieces[-1][1] == len(text)
    boundaries = {end for end in itertools.accumulate(len(p) for p in split_text(text, 16))}
    for done, (_, end) in enumerate(pieces[:-1]):
        assert end in boundaries
        rest = _flat(encode_large(tok, text, end, chunk_chars=16, max_chunks=8))
        assert _flat(pieces[: done + 1]) + rest == tok.encode_batch([text])[0]
        assert BOS not in rest


def test_real_tokenizer_chunks_only_differ_near_cuts(tokenizer):
    doc = "def f(x):\n    return x + 1\n" * 400
    whole = tokenizer.encode_batch([doc])[0]
    chunked = _flat(encode_large(tokenizer, doc, chunk_chars=2000))
    assert chunked[0] == whole[0] == tokenizer.bos_id and chunked[-1] == whole[-1] == tokenizer.eos_id
    assert tokenizer.decode(chunked) == tokenizer.decode(whole)  # the same text; tokens may differ only at cuts
    # Within 1% in length: each of the ~6 cuts can change a token or two.
    assert abs(len(chunked) - len(whole)) <= len(whole) // 100


DOCS = ["a small one\n" * 3, "".join(f"line {i}: def f(x): return x * {i}\n" for i in range(600)), "tiny",
        "second small\n", "".join(f"{i} word{i % 7} " for i in range(3000))]
"""Two documents far over the (lowered) large threshold, spanning 40 and more chunks, among small ones."""


def _unstreamed_batches(tokenizer, docs, seq_len: int, batch: int) -> list[torch.Tensor]:
    """Inputs of every full batch the loader produced before streaming: each large document tokenised
    whole (in its chunks) first, then everything packed (a finite pass adds one last partial batch)."""
    stream: list[int] = []
    for doc in docs:
        if len(doc) > chunked_encode.LARGE_DOCUMENT_CHARS:
            chunks = tokenizer.encode_batch(split_text(doc), bos=False, eos=False)
            stream += [tokenizer.bos_id, *itertools.chain.from_iterable(chunks), tokenizer.eos_id]
        else:
            stream += tokenizer.encode_batch([doc])[0]
    window = seq_len + 1
    n = len(stream) // (window * batch)
    windows = torch.tensor(stream[: n * window * batch]).view(n, batch, window)
    return [w[:, :-1] for w in windows]


@pytest.fixture
def small_thresholds(monkeypatch):
    monkeypatch.setattr(chunked_encode, "LARGE_DOCUMENT_CHARS", 2000)
    monkeypatch.setattr(chunked_encode, "CHUNK_CHARS", 500)


@pytest.mark.parametrize("streaming", [False, True])
def test_streamed_windows_equal_the_unstreamed_ones_and_resume_inside_a_document(tmp_path, tokenizer,
                                                                               small_thresholds, streaming):
    path = tmp_path / "docs.jsonl"
    path.write_text("".join(json.dumps({"text": d}) + "\n" for d in DOCS))
    cfg = TextDataLoader.Config(dataset=str(path), shuffle="none", streaming=streaming)
    expected = _unstreamed_batches(tokenizer, DOCS, seq_len=31, batch=2)
    assert len(expected) > 60
    got = [inputs for inputs, _ in _build(cfg, tokenizer, seq_len=31, batch=2, infinite=False)]
    assert all(torch.equal(a, b) for a, b in zip(got, expected, strict=False)) and len(got) - len(expected) in (0, 1)

    inside = 0
    for cut in (1, 7, 20, 45, len(expected) - 3):
        loader = _build(cfg, tokenizer, seq_len=31, batch=2)
        _take(loader, cut)
        state = _roundtrip(loader.state_dict())
        inside += state.get("resume_char", 1) > 0  # a store's position is a window count, inside any document
        resumed = _build(cfg, tokenizer, seq_len=31, batch=2)
        resumed.load_state_dict(state)
        rest = [inputs for inputs, _ in _take(resumed, 3)]
        assert all(torch.equal(a, b) for a, b in zip(rest, expected[cut:cut + 3], strict=True)), cut
    assert inside >= 3  # most cuts stop inside a streamed document


def test_a_50_mb_document_gives_its_first_batch_after_one_chunk(tmp_path, tokenizer):
    block = "".join(f"    value_{i} = compute({i}, other={i * 7})  # step {i}\n" for i in range(200))
    doc = block * (50_000_000 // len(block) + 1)
    path = tmp_path / "huge.jsonl"
    path.write_text(json.dumps({"text": doc}) + "\n" + json.dumps({"text": "after it"}) + "\n")
    # Streamed: a random-access source is tokenised whole into its store before its first batch.
    cfg = TextDataLoader.Config(dataset=str(path), shuffle="none", streaming=True)
    loader = _build(cfg, tokenizer, seq_len=255, batch=8)
    it = iter(loader)
    first = next(it)
    state = loader.state_dict()
    # Only the first chunk is tokenised: the position stands inside the document, the buffer holds the
    # rest of that chunk's tokens, not the document's (millions).
    assert 0 < state["resume_char"] <= chunked_encode.CHUNK_CHARS and state["resume_doc"] == 0
    assert len(state["buffer"]) < chunked_encode.CHUNK_CHARS
    assert first[0][0, 0] == tokenizer.bos_id
    second = next(it)
    resumed = _build(cfg, tokenizer, seq_len=255, batch=8)
    resumed.load_state_dict(_roundtrip(state))
    assert torch.equal(next(iter(resumed))[0], second[0])
    assert np.asarray(first[0]).shape == (8, 255)
