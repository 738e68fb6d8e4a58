"""The global window order: which window each position reads, and that a run resumed on other layouts reads
exactly the order's prefix (windows.py states the guarantee)."""
import io
import json
from collections import Counter

import datasets
import numpy as np
import pytest
import torch
from _char_tokenizer import BOS, EOS, OFFSET, CharTokenizer

from torchtitan_lite.components.data import TextDataLoader
from torchtitan_lite.components.data.windows import epoch_permutation, rank_positions

SEQ_LEN = 7




@pytest.fixture(autouse=True)
def isolated_hf_cache(tmp_path, monkeypatch):
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hf-cache"))


@pytest.fixture
def corpus(tmp_path):
    # Distinct documents, so that no two windows hold the same tokens: a window's tokens name its id.
    docs = [f"{i:02d}" + "abcdefghij"[i % 10] * (i % 5) for i in range(30)]
    path = tmp_path / "docs.jsonl"
    path.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    return str(path)


def _roundtrip(state):
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


def _build(path, rank, world, batch, shuffle="windows", **kw):
    return TextDataLoader.Config(dataset=path, shuffle=shuffle).build(
        tokenizer=CharTokenizer(), dp_rank=rank, dp_world_size=world, seq_len=SEQ_LEN, local_batch_size=batch,
        seed=11, **kw)


def _window_ids(loader) -> dict[tuple, int]:
    """Window id of every window's tokens, from the store itself."""
    window = SEQ_LEN + 1
    return {tuple(loader.store.tokens(k * window, (k + 1) * window).tolist()): k for k in range(loader.n_windows)}


def _run_steps(path, states, *, world, batch, micro, steps):
    """``steps`` optimizer steps on ``world`` data-parallel ranks of local batch ``batch`` and ``micro``
    micro-batches, resumed from ``states`` (every rank's, or None): the window ids each global position got,
    and the states the ranks save after the last step."""
    loaders = [_build(path, r, world, batch) for r in range(world)]
    if states is not None:
        for loader in loaders:
            loader.load_rank_states(states)
    start = loaders[0].consumed
    ids = _window_ids(loaders[0])
    iterators = [iter(loader) for loader in loaders]
    read: dict[int, int] = {}
    for step in range(steps):
        for m in range(micro):
            for r, it in enumerate(iterators):
                inputs, labels = next(it)
                for b, (x, y) in enumerate(zip(inputs, labels, strict=True)):
                    position = start + step * batch * world * micro + m * batch * world + b * world + r
                    assert position not in read, f"position {position} read twice"
                    read[position] = ids[tuple(torch.cat([x, y[-1:]]).tolist())]
    return read, [_roundtrip(loader.state_dict()) for loader in loaders]


def test_a_resume_over_any_layout_reads_exactly_the_orders_prefix(corpus):
    # DP 2 -> 1 process (2 micro-batches, the same global batch) -> DP 4 -> a global batch of 6 instead of 4.
    # 54 positions over ~25 windows per epoch: the chain crosses two epoch boundaries.
    phases = [dict(world=2, batch=2, micro=1, steps=3), dict(world=1, batch=2, micro=2, steps=3),
              dict(world=4, batch=1, micro=1, steps=3), dict(world=2, batch=3, micro=1, steps=3)]
    read: dict[int, int] = {}
    states = None
    for phase in phases:
        got, states = _run_steps(corpus, states, **phase)
        assert not read.keys() & got.keys()
        read.update(got)
    n = _build(corpus, 0, 1, 1).n_windows
    assert 15 < n < 27
    total = sum(p["world"] * p["batch"] * p["micro"] * p["steps"] for p in phases)
    assert sorted(read) == list(range(total)) and states[0]["consumed"] == total
    expected = [int(epoch_permutation(n, 11, p // n)[p % n]) for p in range(total)]
    # Position by position the permutation of its epoch: nothing skipped, nothing read twice in an epoch.
    assert [read[p] for p in range(total)] == expected
    for epoch in range(total // n):
        assert sorted(read[p] for p in range(epoch * n, (epoch + 1) * n)) == list(range(n))
    assert expected[:n] != expected[n:2 * n]  # each epoch draws its own permutation


@pytest.mark.parametrize("shuffle", ["windows", "documents", "none"])
def test_every_order_reads_over_a_chain_of_layouts_what_one_rank_reads_alone(corpus, shuffle):
    # The same chain as above, compared row by row with one rank of batch 1 reading the order from the start.
    alone = iter(_build(corpus, 0, 1, 1, shuffle=shuffle))
    reference = [torch.cat([x[0], y[0, -1:]]) for x, y in (next(alone) for _ in range(54))]
    phases = [(2, 2, 1), (1, 2, 2), (4, 1, 1), (2, 3, 1)]
    states, start = None, 0
    for world, batch, micro in phases:
        loaders = [_build(corpus, r, world, batch, shuffle=shuffle) for r in range(world)]
        for loader in loaders:
            if states is not None:
                loader.load_rank_states(states)
        iterators = [iter(loader) for loader in loaders]
        for _ in range(3 * micro):
            for r, it in enumerate(iterators):
                x, y = next(it)
                for b in range(len(x)):
                    assert torch.equal(torch.cat([x[b], y[b, -1:]]), reference[start + b * world + r])
            start += batch * world
        states = [_roundtrip(loader.state_dict()) for loader in loaders]
    assert start == 54


def test_rank_positions_stride_one_global_micro_batch():
    assert rank_positions(12, 3, 1, 4).tolist() == [13, 17, 21]
    together = sorted(p for r in range(4) for p in rank_positions(12, 3, r, 4).tolist())
    assert together == list(range(12, 24))


def test_orders_none_and_documents_read_the_stream_and_shuffle_documents_per_epoch(corpus):
    plain = _build(corpus, 0, 1, 4, shuffle="none", infinite=False)
    window = SEQ_LEN + 1
    stream = plain.store.tokens(0, plain.store.n_tokens)
    rows = torch.cat([torch.cat([x, y[:, -1:]], dim=1) for x, y in plain])
    assert rows.tolist() == stream[:plain.n_windows * window].reshape(-1, window).tolist()

    def documents(epochs):
        loader = _build(corpus, 0, 1, 1, shuffle="documents")
        it = iter(loader)
        per_epoch = []
        for _ in range(epochs):
            tokens = torch.cat([torch.cat([x[0], y[0, -1:]]) for x, y in (next(it) for _ in range(loader.n_windows))])
            per_epoch.append("".join(chr(t - OFFSET) if t > EOS else "|" for t in tokens.tolist()))
        return per_epoch

    first, second = documents(2)
    # Whole documents in a permuted order, another one in the next epoch, and the same for the same seed.
    in_order = "".join(f"|{i:02d}" for i in range(30))
    assert first.count("||") > 20 and first[:40] != in_order[:40] and first != second
    assert documents(2) == [first, second]


def test_each_row_carries_its_document_starts(corpus):
    loader = _build(corpus, 0, 1, 4, shuffle="documents")
    for _ in range(3):
        batch = next(iter(loader))
        for row, starts in zip(batch.inputs, batch.doc_starts, strict=True):
            # The starts are exactly the BOS positions of the inputs (this tokenizer uses BOS nowhere else).
            assert starts.tolist() == torch.nonzero(row == BOS).flatten().tolist()
        ids = batch.document_ids()
        assert ids.shape == batch.inputs.shape and torch.equal(ids[:, 0], torch.zeros(4, dtype=torch.int64))
    assert sum(len(s) for s in batch.doc_starts) > 0


def test_a_permutation_depends_on_seed_and_epoch_only():
    a = epoch_permutation(1000, 3, 0)
    assert np.array_equal(a, epoch_permutation(1000, 3, 0)) and sorted(a.tolist()) == list(range(1000))
    assert not np.array_equal(a, epoch_permutation(1000, 3, 1)) and not np.array_equal(a, epoch_permutation(1000, 4, 0))
    assert Counter(a[:10].tolist()) != Counter(range(10))
