"""A weighted mixture (data.sources): the interleave's counts, its resume over layouts, the token shares, and
the settings it refuses (mixture.py states the guarantees)."""
import io
import json

import datasets
import numpy as np
import pytest
import tomllib
import torch
from _char_tokenizer import BOS, CharTokenizer

from torchtitan_lite.components.data import TextDataLoader
from torchtitan_lite.components.data.errors import DataSourceError
from torchtitan_lite.components.data.mixture import MixtureOrder, source_seed
from torchtitan_lite.components.data.mixture_source import MixtureSource
from torchtitan_lite.components.data.windows import epoch_permutation
from torchtitan_lite.config.overrides import apply_overrides, overrides_from_dict

SEQ_LEN = 7
SEED = 11




@pytest.fixture(autouse=True)
def isolated_hf_cache(tmp_path, monkeypatch):
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hf-cache"))


@pytest.fixture
def corpora(tmp_path):
    """Two sources of the same size and shape, in letters no other source uses: a window's tokens name its
    source and its id, and both sources have the same number of windows."""
    paths = {}
    for name, letters in (("code", "abcdefghij"), ("prose", "klmnopqrst")):
        docs = [f"{i:02d}" + letters[i % 10] * (i % 5) for i in range(30)]
        path = tmp_path / f"{name}.jsonl"
        path.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
        paths[name] = str(path)
    return paths


def _config(paths, weights=(3, 1)):
    return TextDataLoader.Config(sources=[MixtureSource(name=n, weight=w, dataset=p)
                                          for (n, p), w in zip(paths.items(), weights, strict=True)])


def _build(paths, rank, world, batch, weights=(3, 1)):
    return _config(paths, weights).build(tokenizer=CharTokenizer(), dp_rank=rank, dp_world_size=world,
                                         seq_len=SEQ_LEN, local_batch_size=batch, seed=SEED)


def _window_ids(loader) -> dict[tuple, tuple[int, int]]:
    """(source, window id) of every window's tokens, from the sources' stores."""
    w = SEQ_LEN + 1
    return {tuple(src.store.tokens(k * w, (k + 1) * w).tolist()): (s, k)
            for s, src in enumerate(loader.loaders) for k in range(src.n_windows)}


def _roundtrip(state):
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


# --------------------------------------------------------------------------------------------------
# The interleave


@pytest.mark.parametrize("weights", [(3, 1), (0.5, 0.3, 0.2), (1, 1, 1, 0.05)])
def test_each_source_gets_its_share_within_one_window_at_every_block(weights):
    order = MixtureOrder(weights, seed=SEED)
    shares = np.asarray(weights, dtype=np.float64) / sum(weights)
    k = order.block
    assert k >= 64 and all(k * s >= 1 for s in shares)
    n_blocks = 60
    sources, local = order.locate(np.arange(n_blocks * k))
    for b in range(1, n_blocks + 1):
        counts = np.bincount(sources[:b * k], minlength=len(weights))
        # At a block's end the cumulative targets hold: less than one window from n w, however many blocks.
        assert np.all(np.abs(counts - b * k * shares) < 1), (b, counts, b * k * shares)
        assert np.array_equal(counts, order.counts(b * k))
    for n in (1, 17, k + 5, 7 * k + 33):  # inside a block: at most that block's share (and one) away
        counts = order.counts(n)
        assert counts.sum() == n and np.all(np.abs(counts - n * shares) <= k * shares + 1)
        assert np.array_equal(counts, np.bincount(sources[:n], minlength=len(weights)))
    for s in range(len(weights)):
        # Each source reads its own positions 0, 1, 2, ... in the global order: none twice, none skipped.
        assert local[sources == s].tolist() == list(range(int((sources == s).sum())))


def test_the_interleave_is_reproducible_and_seeded():
    a, b = MixtureOrder([3, 1], seed=5), MixtureOrder([3, 1], seed=5)
    positions = np.arange(1000)[::-1]  # random access, in any order
    assert all(np.array_equal(x, y) for x, y in zip(a.locate(positions), b.locate(np.arange(1000)[::-1]),
                                                    strict=True))
    other = MixtureOrder([3, 1], seed=6).locate(positions)[0]
    assert not np.array_equal(a.locate(positions)[0], other)
    # Blocks mix the sources rather than reading them in runs: the minority source is not all at a block's end.
    first_block = a.locate(np.arange(64))[0]
    assert 0 < np.flatnonzero(first_block == 1).min() < 40
    assert source_seed(5, "code") != source_seed(5, "prose") and source_seed(5, "code") != source_seed(6, "code")


# --------------------------------------------------------------------------------------------------
# The loader


def test_a_mixture_resumed_over_any_layout_reads_each_sources_order_prefix(corpora):
    # DP 2 -> 1 process (2 micro-batches, the same global batch) -> DP 4 -> a global batch of 6 instead of 4;
    # 54 positions, about 40 of the major source: it crosses an epoch boundary of ~25 windows.
    phases = [(2, 2, 1), (1, 2, 2), (4, 1, 1), (2, 3, 1)]
    read: dict[int, tuple[int, int]] = {}
    states, start = None, 0
    for world, batch, micro in phases:
        loaders = [_build(corpora, r, world, batch) for r in range(world)]
        for loader in loaders:
            if states is not None:
                loader.load_rank_states(states)
        assert loaders[0].consumed == start
        ids = _window_ids(loaders[0])
        iterators = [iter(loader) for loader in loaders]
        for _ in range(3 * micro):
            for r, it in enumerate(iterators):
                x, y = next(it)
                for b in range(len(x)):
                    position = start + b * world + r
                    assert position not in read, f"position {position} read twice"
                    read[position] = ids[tuple(torch.cat([x[b], y[b, -1:]]).tolist())]
            start += batch * world
        states = [_roundtrip(loader.state_dict()) for loader in loaders]
    total = 54
    assert sorted(read) == list(range(total)) and states[0]["consumed"] == total
    names = list(corpora)
    n = loaders[0].loaders[0].n_windows
    assert n == loaders[0].loaders[1].n_windows and 15 < n < 27
    order = MixtureOrder([3, 1], SEED)
    sources, local = order.locate(np.arange(total))
    # Position by position: the interleave's source, and that source's own window order at its own position.
    expected = [(s, int(epoch_permutation(n, source_seed(SEED, names[s]), q // n)[q % n]))
                for s, q in zip(sources.tolist(), local.tolist(), strict=True)]
    assert [read[p] for p in range(total)] == expected
    per_source = [[k for s, k in (read[p] for p in range(total)) if s == i] for i in range(2)]
    assert [len(w) for w in per_source] == order.counts(total).tolist() and len(per_source[0]) > n
    assert sorted(per_source[0][:n]) == list(range(n))  # a whole epoch of the major source, each window once
    # Each source draws its own permutation (same size, so one shared permutation would read the same ids).
    assert per_source[1] != per_source[0][:len(per_source[1])]


def test_weights_3_to_1_give_75_percent_of_the_tokens_over_2000_windows(corpora):
    loader = _build(corpora, 0, 1, 50)
    ids = _window_ids(loader)
    tokens = [0, 0]
    for x, y in (next(it) for it in [iter(loader)] for _ in range(40)):
        for row in torch.cat([x, y[:, -1:]], dim=1):
            tokens[ids[tuple(row.tolist())][0]] += SEQ_LEN
    assert loader.consumed == 2000
    assert abs(tokens[0] / sum(tokens) - 0.75) <= 0.02 and abs(tokens[0] - 1500 * SEQ_LEN) <= 2 * SEQ_LEN
    assert loader.tokens_per_source() == {"code": tokens[0], "prose": tokens[1]}


def test_each_row_carries_its_document_starts(corpora):
    batch = next(iter(_build(corpora, 0, 1, 8)))
    for row, starts in zip(batch.inputs, batch.doc_starts, strict=True):
        assert starts.tolist() == torch.nonzero(row == BOS).flatten().tolist()
    assert sum(len(s) for s in batch.doc_starts) > 0


def test_a_position_saved_for_other_weights_is_refused(corpora):
    loader = _build(corpora, 0, 1, 4)
    next(iter(loader))
    with pytest.raises(ValueError, match="only valid for the same sources, weights and tokens"):
        _build(corpora, 0, 1, 4, weights=(1, 1)).load_state_dict(loader.state_dict())


# --------------------------------------------------------------------------------------------------
# Settings


def test_sources_read_from_toml_tables():
    text = """
[data]
shuffle = "windows"
[[data.sources]]
name = "code"
weight = 3
dataset = "code.jsonl"
validation_files = "code-val.jsonl"
[[data.sources]]
name = "prose"
weight = 1
dataset = "prose.jsonl"
"""
    from torchtitan_lite.trainer import Trainer

    cfg = apply_overrides(Trainer.Config(), overrides_from_dict(tomllib.loads(text), "mix.toml"))
    assert [(s.name, s.weight, s.dataset, s.validation_files) for s in cfg.data.sources] == [
        ("code", 3, "code.jsonl", "code-val.jsonl"), ("prose", 1, "prose.jsonl", None)]
    single = cfg.data.source_config(1)
    assert single.dataset == "prose.jsonl" and single.sources == [] and single.shuffle == "windows"
    from torchtitan_lite.config.toml_io import config_to_toml

    again = apply_overrides(Trainer.Config(), overrides_from_dict(tomllib.loads(config_to_toml(cfg)), "saved"))
    assert again.data.sources == cfg.data.sources


@pytest.mark.parametrize("weight", [0, -1.5, float("nan")])
def test_a_weight_that_is_not_positive_is_refused_naming_the_source(weight):
    with pytest.raises(ValueError, match=r"source 'prose' has weight=.*must be a positive number: set it above 0"):
        MixtureSource(name="prose", weight=weight, dataset="p.jsonl")


@pytest.mark.parametrize("change, message", [
    (dict(sources=[MixtureSource(name="a"), MixtureSource(name="a")]), "names 'a' more than once"),
    (dict(sources=[MixtureSource(name="a"), MixtureSource()]), r"data.sources.1 .* has name=''; give it a name"),
    (dict(sources=[MixtureSource(name="a")], streaming=True, shuffle="none"), "a mixture of streams is not supported"),
    (dict(sources=[MixtureSource(name="a")], token_store="/tmp/s"), "set token_store in each source's table"),
])
def test_mixture_settings_that_cannot_work_are_refused(change, message):
    with pytest.raises(ValueError, match=message):
        TextDataLoader.Config(**change)


def test_a_missing_source_is_refused_naming_it_and_its_field(corpora, tmp_path):
    from torchtitan_lite.components.data.readiness import data_problems
    from torchtitan_lite.components.tokenizer import Tokenizer

    paths = {"code": corpora["code"], "prose": str(tmp_path / "nowhere" / "prose.jsonl")}
    with pytest.raises(DataSourceError, match=r"source 'prose' \(data.sources.1\): .*nowhere/prose.jsonl"):
        _build(paths, 0, 1, 4)
    problems = data_problems(_config(paths), Tokenizer.Config(), validation=False)
    assert len(problems) == 1 and "source 'prose' (data.sources.1): data.sources.1.dataset=" in problems[0]
    assert "nowhere/prose.jsonl" in problems[0]
