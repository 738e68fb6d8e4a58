import dataclasses
import io
import json
import time

import datasets
import pytest
import torch
from _char_tokenizer import BOS, EOS, OFFSET, CharTokenizer

from torchtitan_lite.components.data import DataSourceError, TextDataLoader
from torchtitan_lite.components.tokenizer import Tokenizer


@pytest.fixture(autouse=True)
def isolated_hf_cache(tmp_path, monkeypatch):
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hf-cache"))


@pytest.fixture(scope="module")
def tokenizer():
    return Tokenizer.Config().build()


def _write_shards(tmp_path, n_docs=40, n_files=4):
    docs = [f"doc{i:03d}" + "z" * (i % 9) for i in range(n_docs)]
    for f in range(n_files):
        (tmp_path / f"part-{f}.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs[f::n_files]))
    return str(tmp_path / "part-*.jsonl"), docs


def _build(cfg, tokenizer, rank=0, world=1, seq_len=32, batch=4, **kw):
    return cfg.build(tokenizer=tokenizer, dp_rank=rank, dp_world_size=world, seq_len=seq_len,
                     local_batch_size=batch, **kw)


def _take(loader, n):
    it = iter(loader)
    return [next(it) for _ in range(n)]


def _roundtrip(state):
    """What a checkpoint does to the state: torch.save, then a weights_only load."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


def _doc_ids(batches):
    tokens = [t for inputs, labels in batches for x, y in zip(inputs, labels) for t in x.tolist() + y[-1:].tolist()]
    text = "".join("<" if t == BOS else ">" if t == EOS else chr(t - OFFSET) for t in tokens)
    return {d.lstrip("<")[:6] for d in text.split(">")[:-1]}  # every window run starts at a BOS


# --------------------------------------------------------------------------------------------------
# Sharding


@pytest.mark.parametrize("n_files", [4, 3])
def test_two_stream_ranks_see_disjoint_documents_that_cover_the_data(tmp_path, n_files):
    # 4 files over 2 ranks: whole files per rank; 3 files: every other document.
    pattern, docs = _write_shards(tmp_path, n_files=n_files)
    cfg = TextDataLoader.Config(dataset=pattern, streaming=True, shuffle="none")
    seen = [_doc_ids(_build(cfg, CharTokenizer(), rank=r, world=2, seq_len=15, batch=2, infinite=False))
            for r in range(2)]
    assert not seen[0] & seen[1]
    expected = {d[:6] for d in docs}
    # A finite pass drops the final partial window (< 16 tokens): at most 2 short documents per rank.
    assert len(expected - (seen[0] | seen[1])) <= 4 and seen[0] | seen[1] <= expected
    assert min(len(s) for s in seen) >= 15


def test_a_finite_pass_splits_every_window_once_across_ranks(tmp_path):
    pattern, _ = _write_shards(tmp_path)
    cfg = TextDataLoader.Config(dataset=pattern, shuffle="none")
    one = torch.cat([x for x, _ in _build(cfg, CharTokenizer(), seq_len=9, batch=3, infinite=False)])
    ranks = [[x for x, _ in _build(cfg, CharTokenizer(), rank=r, world=2, seq_len=9, batch=3, infinite=False)]
             for r in range(2)]
    # Rank r of 2 reads windows r, r + 2, ...: together the one-rank pass, in its order.
    assert torch.equal(torch.cat(ranks[0]), one[0::2]) and torch.equal(torch.cat(ranks[1]), one[1::2])


def test_ranks_take_a_stride_of_one_global_batch(tokenizer):
    # One rank's batch of 4 is the global micro-batch; rank r of 2 with batches of 2 takes its rows r, r + 2.
    one = next(iter(_build(TextDataLoader.Config(), tokenizer, batch=4, seed=4)))[0]
    halves = [next(iter(_build(TextDataLoader.Config(), tokenizer, rank=r, world=2, batch=2, seed=4)))[0]
              for r in range(2)]
    assert torch.equal(halves[0], one[0::2]) and torch.equal(halves[1], one[1::2])
    assert not torch.equal(halves[0], halves[1])


# --------------------------------------------------------------------------------------------------
# Exact resume


def _assert_resumes_exactly(make, total=7, cut=3):
    reference = _take(make(), total)
    interrupted = make()
    _take(interrupted, cut)
    state = _roundtrip(interrupted.state_dict())
    resumed = make()
    resumed.load_state_dict(state)
    for (x, y), (rx, ry) in zip(reference[cut:], _take(resumed, total - cut)):
        assert torch.equal(x, rx) and torch.equal(y, ry)


def test_resume_windows_embedded(tokenizer):
    _assert_resumes_exactly(lambda: _build(TextDataLoader.Config(), tokenizer, rank=1, world=2, seed=0))


def test_resume_streaming_embedded(tokenizer):
    cfg = TextDataLoader.Config(streaming=True, shuffle="none")
    _assert_resumes_exactly(lambda: _build(cfg, tokenizer, rank=1, world=2))


@pytest.mark.parametrize("streaming,shuffle,buffer", [(False, "windows", 0), (False, "documents", 0),
                                                      (True, "none", 0), (True, "none", 5)])
def test_resume_across_epochs_at_every_cut(tmp_path, streaming, shuffle, buffer):
    # ~20 short documents per rank and epoch, ~8 batches: the cuts fall in at least three epochs.
    pattern, _ = _write_shards(tmp_path, n_files=3)
    cfg = TextDataLoader.Config(dataset=pattern, streaming=streaming, shuffle=shuffle, shuffle_buffer=buffer)
    make = lambda: _build(cfg, CharTokenizer(), rank=0, world=2, seq_len=9, batch=3, seed=5)  # noqa: E731
    reference = _take(make(), 30)
    for cut in (1, 4, 11, 17, 23):
        loader = make()
        _take(loader, cut)
        resumed = make()
        resumed.load_state_dict(_roundtrip(loader.state_dict()))
        assert all(torch.equal(a[0], b[0]) for a, b in zip(reference[cut:], _take(resumed, 30 - cut)))
    if streaming:
        assert loader.state_dict()["epoch"] >= 2
    else:
        assert loader.state_dict()["consumed"] // loader.n_windows >= 2


def test_resume_keeps_an_unseeded_shuffle_order(tmp_path):
    pattern, _ = _write_shards(tmp_path)
    cfg = TextDataLoader.Config(dataset=pattern)
    running = _build(cfg, CharTokenizer(), seq_len=9, batch=2, seed=None)
    it = iter(running)
    for _ in range(5):
        next(it)
    state = _roundtrip(running.state_dict())
    resumed = _build(cfg, CharTokenizer(), seq_len=9, batch=2, seed=None)
    assert resumed.seed != running.seed  # a fresh random order, until the saved one is loaded
    resumed.load_state_dict(state)
    assert all(torch.equal(next(it)[0], b[0]) for b in _take(resumed, 20))


def test_a_shuffle_over_several_ranks_needs_a_shared_seed(tmp_path):
    pattern, _ = _write_shards(tmp_path)
    with pytest.raises(ValueError, match=r"data.shuffle='windows' on 2 data-parallel ranks needs one seed shared"):
        _build(TextDataLoader.Config(dataset=pattern), CharTokenizer(), rank=1, world=2, seed=None)


def test_resume_a_finite_pass(tmp_path):
    pattern, _ = _write_shards(tmp_path)
    make = lambda: _build(TextDataLoader.Config(dataset=pattern, shuffle="none"), CharTokenizer(),  # noqa: E731
                          seq_len=9, batch=2, infinite=False)
    reference = list(make())
    loader = make()
    _take(loader, 5)
    resumed = make()
    resumed.load_state_dict(_roundtrip(loader.state_dict()))
    rest = list(resumed)
    assert len(rest) == len(reference) - 5
    assert all(torch.equal(a[1], b[1]) for a, b in zip(reference[5:], rest))


def test_state_holds_plain_values_only(tokenizer):
    loader = _build(TextDataLoader.Config(), tokenizer, seed=3)
    _take(loader, 2)
    state = loader.state_dict()
    assert state == {
        "format": 3, "dataset": "embedded", "split": "train", "store": loader.store.identity, "seq_len": 32,
        "shuffle": "windows", "seed": 3, "consumed": 8, "dp_rank": 0, "dp_world_size": 1, "local_batch_size": 4,
    }
    assert _roundtrip(state) == state


def test_tensor_parallel_peers_and_other_degrees_resume_from_one_position(tmp_path):
    pattern, _ = _write_shards(tmp_path)
    cfg = TextDataLoader.Config(dataset=pattern)
    reference = [_build(cfg, CharTokenizer(), rank=r, world=2, seq_len=7, batch=2, seed=1) for r in range(2)]
    iters = [iter(loader) for loader in reference]
    for it in iters:
        next(it)
    # Four global ranks (dp 2 x tp 2) saved; each data-parallel rank's state twice.
    states = [_roundtrip(reference[r].state_dict()) for r in (0, 0, 1, 1)]
    following = [next(it)[0] for it in iters]
    for r in range(2):
        resumed = _build(cfg, CharTokenizer(), rank=r, world=2, seq_len=7, batch=2, seed=1)
        resumed.load_rank_states(states)
        assert torch.equal(next(iter(resumed))[0], following[r])
    # One rank of batch 4 reads the same global micro-batch: rank 0's rows, then rank 1's, interleaved.
    single = _build(cfg, CharTokenizer(), seq_len=7, batch=4, seed=1)
    single.load_rank_states(states)
    rows = next(iter(single))[0]
    assert torch.equal(rows[0::2], following[0]) and torch.equal(rows[1::2], following[1])


def test_a_streaming_position_is_not_resharded(tmp_path):
    pattern, _ = _write_shards(tmp_path)
    cfg = TextDataLoader.Config(dataset=pattern, streaming=True, shuffle="none")
    states = [_build(cfg, CharTokenizer(), rank=r, world=2, seq_len=7, batch=2).state_dict() for r in range(2)]
    single = _build(cfg, CharTokenizer(), seq_len=7, batch=2)
    with pytest.raises(ValueError, match=r"saved by 2 data-parallel rank\(s\) reading a streaming dataset .* this run "
                                         r"has 1: .* does not reshard\. Resume with a data-parallel degree of 2"):
        single.load_rank_states(states)
    with pytest.raises(ValueError, match=r"saved with dp_world_size=2, this loader has dp_world_size=1"):
        single.load_state_dict(states[0])


@pytest.mark.parametrize("change,message", [
    (dict(seq_len=64), r"saved with seq_len=32, this loader has seq_len=64"),
    (dict(shuffle="documents"), r"saved with shuffle='windows', this loader has shuffle='documents'"),
])
def test_state_of_another_seq_len_or_order_is_rejected(tmp_path, change, message):
    pattern, _ = _write_shards(tmp_path)
    saved = _build(TextDataLoader.Config(dataset=pattern), CharTokenizer(), seq_len=32, seed=0).state_dict()
    cfg = TextDataLoader.Config(dataset=pattern, shuffle=change.pop("shuffle", "windows"))
    with pytest.raises(ValueError, match=message + ".*excluding 'dataloader' from checkpoint loading"):
        _build(cfg, CharTokenizer(), **(dict(seq_len=32, seed=0) | change)).load_state_dict(saved)


def test_state_of_other_data_or_an_older_loader_is_rejected(tmp_path):
    pattern, _ = _write_shards(tmp_path)
    saved = _build(TextDataLoader.Config(dataset=pattern), CharTokenizer()).state_dict()
    with pytest.raises(ValueError, match=r"has format 3 \(streaming=None\), this loader reads a stream's position"):
        _build(TextDataLoader.Config(dataset=pattern, streaming=True, shuffle="none"), CharTokenizer()
               ).load_state_dict(saved)
    (tmp_path / "other").mkdir()
    other, _ = _write_shards(tmp_path / "other", n_docs=30)
    with pytest.raises(ValueError, match=r"saved with store='[0-9a-f-]+', this loader has store='[0-9a-f-]+'"):
        _build(TextDataLoader.Config(dataset=other), CharTokenizer()).load_state_dict(saved)
    older = {"format": 2, "dataset": pattern, "split": "train", "streaming": False, "epoch": 0}
    with pytest.raises(ValueError, match=r"has format 2, this loader reads format 3 .* counts documents per rank"):
        _build(TextDataLoader.Config(dataset=pattern), CharTokenizer()).load_rank_states([older])


def test_only_the_newest_iterator_is_live(tmp_path):
    pattern, _ = _write_shards(tmp_path)
    loader = _build(TextDataLoader.Config(dataset=pattern), CharTokenizer(), seq_len=9)
    old = iter(loader)
    next(old)
    new = iter(loader)
    with pytest.raises(RuntimeError, match="iterator is stale.*call iter\\(loader\\) again"):
        next(old)
    next(new)
    loader.load_state_dict(loader.state_dict())
    with pytest.raises(RuntimeError, match="iterator is stale"):
        next(new)


# --------------------------------------------------------------------------------------------------
# Bad documents and arguments


@pytest.mark.parametrize("shuffle,streaming", [("none", False), ("windows", False), ("none", True)])
def test_null_text_names_the_document(tmp_path, shuffle, streaming):
    path = tmp_path / "docs.jsonl"
    path.write_text('{"text": "fine"}\n{"text": "also fine"}\n{"text": null}\n')
    # A local JSON-lines file is scanned before loading: the record is named by file and line.
    with pytest.raises(DataSourceError, match=r"docs\.jsonl:3: text=None is a NoneType, not a string"):
        _build(TextDataLoader.Config(dataset=str(path), shuffle=shuffle, streaming=streaming), CharTokenizer())
    # Sources that are not scanned (here a folder written by save_to_disk) are checked when read (a stream), or
    # when tokenised into their store (before the first batch), naming the row.
    datasets.Dataset.from_dict({"text": ["fine", "also fine", None]}).save_to_disk(str(tmp_path / "saved"))
    cfg = TextDataLoader.Config(dataset=str(tmp_path / "saved"), shuffle=shuffle, streaming=streaming)
    # Streamed, the folder is read as 3 one-row shards (see sources._load_saved).
    where = (r"record 2 of data-parallel rank 0's stream of split 'train' of data.dataset='.*saved', shard 2 "
             r"\(fields \['text'\]\)" if streaming else r"row 2 of split 'train' of data.dataset='.*saved'")
    with pytest.raises(DataSourceError, match=where + r" has text=None \(null\), not a string; fix the record"):
        next(iter(_build(cfg, CharTokenizer())))


def test_bad_build_arguments(tmp_path):
    pattern, _ = _write_shards(tmp_path)
    cfg = TextDataLoader.Config(dataset=pattern)
    with pytest.raises(ValueError, match="dp_rank=2 is not a rank of dp_world_size=2"):
        _build(cfg, CharTokenizer(), rank=2, world=2)
    with pytest.raises(ValueError, match="seq_len=0 and local_batch_size=4 must be positive"):
        _build(cfg, CharTokenizer(), seq_len=0)
    with pytest.raises(ValueError, match="split='test' must be 'train' or 'validation'"):
        _build(cfg, CharTokenizer(), split="test")


def test_a_source_shorter_than_one_window_is_refused(tmp_path):
    (tmp_path / "tiny.jsonl").write_text('{"text": "abc"}\n')
    with pytest.raises(DataSourceError, match=r"holds 5 tokens, fewer than one window of training.seq_len \+ 1 = 16"):
        _build(TextDataLoader.Config(dataset=str(tmp_path / "tiny.jsonl")), CharTokenizer(), seq_len=15)


# --------------------------------------------------------------------------------------------------
# Throughput


def test_reading_windows_outpaces_a_small_cpu_model(tokenizer):
    loader = _build(TextDataLoader.Config(), tokenizer, seq_len=128, batch=8, seed=0)
    it = iter(loader)
    next(it)
    start = time.perf_counter()
    n = sum(next(it)[0].numel() for _ in range(100))
    tokens_per_s = n / (time.perf_counter() - start)
    # Millions of tokens/s measured on 2 busy cores; a ~5M-param model trains at ~10k tokens/s on CPU.
    # The bound leaves a wide margin for machine load and still fails on per-token Python loops.
    assert tokens_per_s > 100_000, tokens_per_s


def test_a_dataset_smaller_than_one_step_warns_once_naming_the_sizes(tmp_path, caplog):
    import logging

    # 7 documents of "abcdefgh" = 7 x (BOS + 8 + EOS) = 70 tokens: 4 windows of 16; a step reads 2 x 4 windows.
    (tmp_path / "tiny.jsonl").write_text("".join(json.dumps({"text": "abcdefgh"}) + "\n" for _ in range(7)))
    cfg = TextDataLoader.Config(dataset=str(tmp_path / "tiny.jsonl"))
    with caplog.at_level(logging.WARNING, logger="torchtitan_lite"):
        _take(_build(cfg, CharTokenizer(), seq_len=15, batch=4), 3)
    assert not [r for r in caplog.records if r.levelno == logging.WARNING]  # 4 windows: exactly one step
    with caplog.at_level(logging.WARNING, logger="torchtitan_lite"):
        _take(_build(cfg, CharTokenizer(), seq_len=15, batch=4, batches_per_step=2), 3)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings == [
        f"split 'train' of data.dataset={str(tmp_path / 'tiny.jsonl')!r} holds 4 window(s) of 16 tokens per epoch, "
        f"fewer than one step reads (training.local_batch_size x data-parallel ranks x local batches per step = "
        f"4 x 1 x 2 = 8), so every step reads the same windows about 2.0 times; add data, or lower "
        f"training.local_batch_size / training.seq_len / training.global_batch_size"]


# --------------------------------------------------------------------------------------------------
# A stream's shuffle buffer


def _rows(batches):
    return [tuple(x.tolist() + y[-1:].tolist()) for inputs, labels in batches for x, y in zip(inputs, labels)]


def test_a_stream_shuffle_buffer_hands_out_every_window_once_in_a_mixed_order(tmp_path):
    """After k batches of B, the windows handed out plus the N held are exactly the stream's first k B + N windows."""
    pattern, _ = _write_shards(tmp_path, n_docs=60, n_files=3)
    plain = TextDataLoader.Config(dataset=pattern, streaming=True, shuffle="none")
    mixed = dataclasses.replace(plain, shuffle_buffer=8)
    build = lambda cfg: _build(cfg, CharTokenizer(), seq_len=9, batch=3, seed=7)  # noqa: E731
    in_order = _rows(_take(build(plain), 12))
    loader = build(mixed)
    out = _rows(_take(loader, 9))
    held = [tuple(row) for row in loader.state_dict()["shuffle"]["held"].tolist()]
    assert len(held) == 8 and sorted(out + held) == sorted(in_order[:27 + 8])
    assert out != in_order[:27]  # mixed: not the stream's order
    # Seeded: the same seed, the same order; another seed, another.
    assert _rows(_take(build(mixed), 9)) == out
    other = _build(mixed, CharTokenizer(), seq_len=9, batch=3, seed=8)
    assert _rows(_take(other, 9)) != out
    # Validation reads the stream in order, buffer or not.
    validation = _build(mixed, CharTokenizer(), seq_len=9, batch=3, seed=7, infinite=False)
    assert _rows(_take(validation, 3)) == in_order[:9]


def test_the_shuffle_buffer_is_refused_where_it_cannot_apply_and_on_a_resume_of_another_size(tmp_path):
    with pytest.raises(ValueError, match=r"data.shuffle_buffer=4 shuffles a stream's windows, but "
                                         r"data.streaming=false: a random-access source is shuffled globally"):
        TextDataLoader.Config(shuffle_buffer=4)
    with pytest.raises(ValueError, match=r"data.shuffle_buffer=-1 is negative"):
        TextDataLoader.Config(streaming=True, shuffle="none", shuffle_buffer=-1)
    pattern, _ = _write_shards(tmp_path)
    cfg = TextDataLoader.Config(dataset=pattern, streaming=True, shuffle="none", shuffle_buffer=4)
    loader = _build(cfg, CharTokenizer(), seq_len=9, batch=2, seed=1)
    _take(loader, 3)
    state = _roundtrip(loader.state_dict())
    for size, message in ((6, "saved with data.shuffle_buffer=4, this run has 6"),
                          (0, "saved with data.shuffle_buffer=4, this run has 0")):
        other = _build(dataclasses.replace(cfg, shuffle_buffer=size), CharTokenizer(), seq_len=9, batch=2, seed=1)
        with pytest.raises(ValueError, match=message):
            other.load_state_dict(state)
