"""A data position moves to another data-parallel degree: across the old and the new layout every document
of the epoch is read exactly once (position.py states the guarantee)."""
import io
import json
import random
from collections import Counter

import datasets
import numpy as np
import pytest
import torch

from torchtitan_lite.components.data import TextDataLoader, chunked_encode
from torchtitan_lite.components.data.position import RankPosition, read_positions, reshard

LAYOUTS = [(2, 1), (1, 2), (2, 4), (4, 2), (3, 2)]


# --------------------------------------------------------------------------------------------------
# The mapping of positions


def _read_some(positions: list[RankPosition], n: int, rng: random.Random, partial: bool) -> None:
    """Each rank reads a random number of its sequence's items, the last one possibly only in part."""
    for p in positions:
        p.read = rng.randrange(0, p.length(n) + 1)
        p.char = rng.randrange(1, 50) if partial and p.read < p.length(n) and rng.random() < 0.5 else 0


def _start(world: int) -> list[RankPosition]:
    return [RankPosition(r, world) for r in range(world)]


def _coverage(history: list[list[RankPosition]], final: list[RankPosition], n: int) -> Counter:
    """How often each position is read: wholly by the ranks of each layout in ``history`` (what they read
    before the reshard), then everything ``final`` has left. A partly read document counts once, at the
    rank that finishes it."""
    count: Counter = Counter()
    for layout in history:
        for p in layout:
            count.update(read_positions(p, n)[0])
    for p in final:
        count.update(p.item(i)[0] for i in range(p.read, p.length(n)))
    return count


@pytest.mark.parametrize("old_world,new_world", LAYOUTS)
@pytest.mark.parametrize("seed", range(4))
def test_reshard_reads_every_document_of_the_epoch_once(old_world, new_world, seed):
    n, rng = 53, random.Random(seed)
    old = _start(old_world)
    _read_some(old, n, rng, partial=True)
    new = [reshard(old, r, new_world, n) for r in range(new_world)]
    assert _coverage([old], new, n) == Counter(range(n))
    # A partly read document continues from its character, first in the rank that got its buffer.
    partial = {p.item(p.read)[0]: (p.char, p.dp_rank % new_world) for p in old if p.char}
    continued = {pos: (char, p.dp_rank) for p in new for pos, char in p.pending if char}
    assert continued == partial
    for p in new:
        chars = [char for _, char in p.pending]
        assert chars == sorted(chars, key=lambda c: c == 0)  # continued documents first


@pytest.mark.parametrize("seed", range(4))
def test_a_chain_of_reshards_still_reads_every_document_once(seed):
    n, rng = 61, random.Random(seed)
    history = []
    layout = _start(2)
    for world in (4, 1, 3, 2):
        _read_some(layout, n, rng, partial=False)
        history.append([RankPosition(p.dp_rank, p.dp_world_size, p.epoch, list(p.pending), p.stride_start, p.stride,
                                     p.read, p.char) for p in layout])
        layout = [reshard(layout, r, world, n) for r in range(world)]
    assert _coverage(history, layout, n) == Counter(range(n))


def test_buffers_are_carried_to_rank_old_rank_mod_new_degree():
    old = [RankPosition(r, 2, buffer=np.array([10 * r + 1, 10 * r + 2], dtype=np.int32)) for r in range(2)]
    merged = reshard(old, 0, 1, 20)
    assert merged.buffer.tolist() == [1, 2, 11, 12]
    widened = [reshard(old[:1] + old[1:], r, 4, 20) for r in range(4)]
    assert [p.buffer.tolist() for p in widened] == [[1, 2], [11, 12], [], []]


def test_ranks_in_different_epochs_continue_in_the_newest():
    # Rank 1 had wrapped into epoch 1 and read 3 of its items there; rank 0 was still in epoch 0. The
    # rest of rank 0's epoch 0 is the stated exception; epoch 1 is read exactly once.
    n = 20
    old = [RankPosition(0, 2, epoch=0, read=7), RankPosition(1, 2, epoch=1, read=3)]
    new = [reshard(old, r, 3, n) for r in range(3)]
    assert {p.epoch for p in new} == {1}
    assert _coverage([[RankPosition(0, 2, epoch=1), old[1]]], new, n) == Counter(range(n))


def test_an_incomplete_set_of_old_ranks_is_refused():
    with pytest.raises(ValueError, match=r"needs the state of every old data-parallel rank; got ranks \[0, 2\]"):
        reshard([RankPosition(0, 3), RankPosition(2, 3)], 0, 1, 10)


# --------------------------------------------------------------------------------------------------
# The data loader: documents -> tokens -> windows, resharded between batches

BOS, EOS, NEWLINE, FIRST_DOC_TOKEN = 1, 2, 3, 100
BASE_CHAR = 0x4E00


class DocTokenizer:
    """One token per character; document i is written in character BASE_CHAR + i, so every token names
    the document it came from."""

    vocab_size = 1000

    def encode_batch(self, texts, bos=True, eos=True):
        return [[BOS] * bos + [NEWLINE if c == "\n" else ord(c) - BASE_CHAR + FIRST_DOC_TOKEN for c in t]
                + [EOS] * eos for t in texts]


def _documents(n: int, large: set[int]) -> list[str]:
    """Document i: 1-13 characters, or 5 lines of 900 (over the lowered large-document threshold)."""
    return [("\n".join([chr(BASE_CHAR + i) * 900] * 5) if i in large else chr(BASE_CHAR + i) * (1 + i * 7 % 13))
            for i in range(n)]


def _roundtrip(state):
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


def _document_tokens(batches) -> Counter:
    """Tokens per document id in ``batches`` (every window counted once: inputs plus the last label)."""
    count: Counter = Counter()
    for inputs, labels in batches:
        tokens = torch.cat([inputs, labels[:, -1:]], dim=1).flatten().tolist()
        count.update(t - FIRST_DOC_TOKEN for t in tokens if t >= FIRST_DOC_TOKEN)
    return count


@pytest.fixture(autouse=True)
def isolated_hf_cache(tmp_path, monkeypatch):
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hf-cache"))


@pytest.mark.parametrize("old_world,new_world", [(2, 1), (1, 2), (2, 4)])
@pytest.mark.parametrize("shuffle", [False, True])
def test_loader_reshard_trains_every_document_token_once(tmp_path, monkeypatch, old_world, new_world, shuffle):
    monkeypatch.setattr(chunked_encode, "LARGE_DOCUMENT_CHARS", 2000)
    monkeypatch.setattr(chunked_encode, "CHUNK_CHARS", 500)
    docs = _documents(90, large={5, 40})
    path = tmp_path / "docs.jsonl"
    path.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    cfg = TextDataLoader.Config(dataset=str(path), shuffle=shuffle)
    seq_len, batch = 15, 2

    def build(rank, world):
        return cfg.build(tokenizer=DocTokenizer(), dp_rank=rank, dp_world_size=world, seq_len=seq_len,
                         local_batch_size=batch, infinite=False, seed=7)

    old = [build(r, old_world) for r in range(old_world)]
    before = [next(it) for loader in old for it in [iter(loader)] for _ in range(9)]
    states = [_roundtrip(loader.state_dict()) for loader in old]
    assert any(s["resume_char"] for s in states) or shuffle  # in file order the cut falls inside document 5
    new = [build(r, new_world) for r in range(new_world)]
    for loader in new:
        loader.load_rank_states(states)
    after = [b for loader in new for b in loader]
    expected = Counter({i: len(d) - d.count("\n") for i, d in enumerate(docs)})
    got = _document_tokens(before) + _document_tokens(after)
    # Nothing repeated; nothing missing but the end of the pass: each rank drops its last partial window.
    assert not got - expected
    assert sum((expected - got).values()) < new_world * (seq_len + 1)


def test_tensor_parallel_peers_on_the_same_layout_resume_exactly(tmp_path):
    path = tmp_path / "docs.jsonl"
    path.write_text("".join(json.dumps({"text": d}) + "\n" for d in _documents(40, large=set())))
    cfg = TextDataLoader.Config(dataset=str(path))

    def build(rank):
        return cfg.build(tokenizer=DocTokenizer(), dp_rank=rank, dp_world_size=2, seq_len=7, local_batch_size=2, seed=1)

    reference = [build(r) for r in range(2)]
    iters = [iter(loader) for loader in reference]
    for it in iters:
        next(it)
    # Four global ranks (dp 2 x tp 2) saved; each data-parallel rank's state twice.
    states = [_roundtrip(reference[r].state_dict()) for r in (0, 0, 1, 1)]
    for r, it in enumerate(iters):
        resumed = build(r)
        resumed.load_rank_states(states)
        assert torch.equal(next(iter(resumed))[0], next(it)[0])


def test_a_streaming_position_is_not_resharded(tmp_path):
    path = tmp_path / "docs.jsonl"
    path.write_text("".join(json.dumps({"text": d}) + "\n" for d in _documents(40, large=set())))
    cfg = TextDataLoader.Config(dataset=str(path), streaming=True, shuffle=False)
    states = [cfg.build(tokenizer=DocTokenizer(), dp_rank=r, dp_world_size=2, seq_len=7, local_batch_size=2
                        ).state_dict() for r in range(2)]
    single = cfg.build(tokenizer=DocTokenizer(), dp_rank=0, dp_world_size=1, seq_len=7, local_batch_size=2)
    with pytest.raises(ValueError, match=r"saved by 2 data-parallel rank\(s\) reading a streaming dataset .* this run "
                                         r"has 1: .* does not reshard\. Resume with a data-parallel degree of 2"):
        single.load_rank_states(states)
