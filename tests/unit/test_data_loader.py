import io
import json
import time

import datasets
import pytest
import torch

from torchtitan_lite.components.data import DataSourceError, TextDataLoader
from torchtitan_lite.components.tokenizer import Tokenizer

BOS, EOS, OFFSET = 1, 2, 10


class CharTokenizer:
    """One token per character, so documents can be read back from the windows."""

    vocab_size = 200

    def encode_batch(self, texts, bos=True, eos=True):
        return [[BOS] * bos + [ord(c) + OFFSET for c in t] + [EOS] * eos for t in texts]


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


@pytest.mark.parametrize("streaming,n_files", [(False, 4), (True, 4), (True, 3)])
def test_two_ranks_see_disjoint_documents_that_cover_the_data(tmp_path, streaming, n_files):
    # 4 files over 2 ranks: whole files per rank; 3 files: every other document.
    pattern, docs = _write_shards(tmp_path, n_files=n_files)
    cfg = TextDataLoader.Config(dataset=pattern, streaming=streaming, shuffle=False)
    seen = [_doc_ids(_build(cfg, CharTokenizer(), rank=r, world=2, seq_len=15, batch=2, infinite=False))
            for r in range(2)]
    assert not seen[0] & seen[1]
    expected = {d[:6] for d in docs}
    # A finite pass drops the final partial window (< 16 tokens): at most 2 short documents per rank.
    assert len(expected - (seen[0] | seen[1])) <= 4 and seen[0] | seen[1] <= expected
    assert min(len(s) for s in seen) >= 15


def test_ranks_read_interleaved_positions_of_one_shared_order(tokenizer):
    # One rank's first group is order positions 0..15; rank r of 2 reads r, r + 2, ..., so its first 8
    # documents are every other one of those (the shuffle seed, hence the order, is shared).
    one = next(_build(TextDataLoader.Config(), tokenizer, seed=4)._document_groups()).texts
    loaders = [_build(TextDataLoader.Config(), tokenizer, rank=r, world=2, seed=4) for r in range(2)]
    halves = [next(loader._document_groups()).texts[:8] for loader in loaders]
    assert halves[0] == one[0::2] and halves[1] == one[1::2] and len(set(one)) == 16
    first = [next(iter(loader)) for loader in loaders]
    assert not torch.equal(first[0][0], first[1][0])


def test_more_ranks_than_documents_is_an_error(tmp_path):
    path = tmp_path / "two.jsonl"
    path.write_text('{"text": "a"}\n{"text": "b"}\n')
    with pytest.raises(DataSourceError, match=r"split 'train' of data.dataset='.*two.jsonl' has 2 document\(s\), "
                                              r"fewer than the 3 data-parallel ranks"):
        _build(TextDataLoader.Config(dataset=str(path)), CharTokenizer(), rank=2, world=3)


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


def test_resume_map_style_embedded(tokenizer):
    _assert_resumes_exactly(lambda: _build(TextDataLoader.Config(), tokenizer, rank=1, world=2, seed=0))


def test_resume_streaming_embedded(tokenizer):
    cfg = TextDataLoader.Config(streaming=True, shuffle=False)
    _assert_resumes_exactly(lambda: _build(cfg, tokenizer, rank=1, world=2))


@pytest.mark.parametrize("streaming", [False, True])
def test_resume_across_epochs_at_every_cut(tmp_path, streaming):
    # ~20 short documents per rank and epoch, ~8 batches: the cuts fall in at least three epochs and
    # at different offsets inside document groups and windows.
    pattern, _ = _write_shards(tmp_path, n_files=3)
    cfg = TextDataLoader.Config(dataset=pattern, streaming=streaming, shuffle=not streaming)
    make = lambda: _build(cfg, CharTokenizer(), rank=0, world=2, seq_len=9, batch=3, seed=5)  # noqa: E731
    reference = _take(make(), 30)
    epochs = set()
    for cut in (1, 4, 11, 17, 23):
        loader = make()
        _take(loader, cut)
        epochs.add(loader.state_dict()["epoch"])
        resumed = make()
        resumed.load_state_dict(_roundtrip(loader.state_dict()))
        assert all(torch.equal(a[0], b[0]) for a, b in zip(reference[cut:], _take(resumed, 30 - cut)))
    assert len(epochs) >= 3


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
    with pytest.raises(ValueError, match=r"data.shuffle on 2 data-parallel ranks needs one seed shared by every rank"):
        _build(TextDataLoader.Config(dataset=pattern), CharTokenizer(), rank=1, world=2, seed=None)


def test_resume_a_finite_pass(tmp_path):
    pattern, _ = _write_shards(tmp_path)
    make = lambda: _build(TextDataLoader.Config(dataset=pattern, shuffle=False), CharTokenizer(),  # noqa: E731
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
    assert {k: v for k, v in state.items() if k != "buffer"} == {
        "format": 2, "dataset": "embedded", "split": "train", "streaming": False, "n_documents": len(loader.documents),
        "dp_rank": 0, "dp_world_size": 1, "seq_len": 32, "vocab_size": 2048, "shuffle_seed": 3, "epoch": 0,
        "pending": [], "stride_start": 0, "stride": 1, "position": 16, "stream_state": None, "bad_records": {},
        "resume_doc": 0, "resume_char": 0,
    }
    assert state["buffer"].dtype == torch.int32 and state["buffer"].dim() == 1


@pytest.mark.parametrize("change,message", [
    (dict(world=4), r"saved with dp_world_size=2, this loader has dp_world_size=4"),
    (dict(rank=1), r"saved with dp_rank=0, this loader has dp_rank=1"),
    (dict(seq_len=64), r"saved with seq_len=32, this loader has seq_len=64"),
])
def test_state_from_another_layout_is_rejected(tmp_path, change, message):
    pattern, _ = _write_shards(tmp_path)
    cfg = TextDataLoader.Config(dataset=pattern)
    saved = _build(cfg, CharTokenizer(), rank=0, world=2, seq_len=32, seed=0).state_dict()
    kwargs = dict(rank=0, world=2, seq_len=32, seed=0) | change
    with pytest.raises(ValueError, match=message + ".*excluding 'dataloader' from checkpoint loading"):
        _build(cfg, CharTokenizer(), **kwargs).load_state_dict(saved)


def test_state_from_other_data_or_order_is_rejected(tmp_path):
    pattern, _ = _write_shards(tmp_path)
    saved = _build(TextDataLoader.Config(dataset=pattern), CharTokenizer()).state_dict()
    with pytest.raises(ValueError, match=r"saved with streaming=False, this loader has streaming=True"):
        _build(TextDataLoader.Config(dataset=pattern, streaming=True, shuffle=False), CharTokenizer()
               ).load_state_dict(saved)
    with pytest.raises(ValueError, match=r"saved with data.shuffle=True, this loader has data.shuffle=False"):
        _build(TextDataLoader.Config(dataset=pattern, shuffle=False), CharTokenizer()).load_state_dict(saved)
    with pytest.raises(ValueError, match=r"saved with dataset='.*part-\*.jsonl', this loader has dataset='embedded'"):
        _build(TextDataLoader.Config(), CharTokenizer()).load_state_dict(saved)


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


@pytest.mark.parametrize("shuffle,streaming", [(False, False), (True, False), (False, True)])
def test_null_text_names_the_document(tmp_path, shuffle, streaming):
    path = tmp_path / "docs.jsonl"
    path.write_text('{"text": "fine"}\n{"text": "also fine"}\n{"text": null}\n')
    # A local JSON-lines file is scanned before loading: the record is named by file and line.
    with pytest.raises(DataSourceError, match=r"docs\.jsonl:3: text=None is a NoneType, not a string"):
        _build(TextDataLoader.Config(dataset=str(path), shuffle=shuffle, streaming=streaming), CharTokenizer())
    # Sources that are not scanned (here a folder written by save_to_disk) are checked when read, naming the row.
    datasets.Dataset.from_dict({"text": ["fine", "also fine", None]}).save_to_disk(str(tmp_path / "saved"))
    loader = _build(TextDataLoader.Config(dataset=str(tmp_path / "saved"), shuffle=shuffle, streaming=streaming),
                    CharTokenizer())
    # Streamed, the folder is read as 3 one-row shards (see sources._load_saved).
    where = (r"record 2 of data-parallel rank 0's stream of split 'train' of data.dataset='.*saved', shard 2 "
             r"\(fields \['text'\]\)" if streaming else
             r"row 2 of split 'train' of data.dataset='.*saved' \(data-parallel rank 0\)")
    with pytest.raises(DataSourceError, match=where + r" has text=None \(null\), not a string; fix the record"):
        next(iter(loader))


def test_bad_build_arguments(tmp_path):
    pattern, _ = _write_shards(tmp_path)
    cfg = TextDataLoader.Config(dataset=pattern)
    with pytest.raises(ValueError, match="dp_rank=2 is not a rank of dp_world_size=2"):
        _build(cfg, CharTokenizer(), rank=2, world=2)
    with pytest.raises(ValueError, match="seq_len=0 and local_batch_size=4 must be positive"):
        _build(cfg, CharTokenizer(), seq_len=0)
    with pytest.raises(ValueError, match="split='test' must be 'train' or 'validation'"):
        _build(cfg, CharTokenizer(), split="test")


# --------------------------------------------------------------------------------------------------
# Throughput


def test_tokenising_on_the_fly_outpaces_a_small_cpu_model(tokenizer):
    loader = _build(TextDataLoader.Config(), tokenizer, seq_len=128, batch=8, seed=0)
    it = iter(loader)
    next(it)
    start = time.perf_counter()
    n = sum(next(it)[0].numel() for _ in range(100))
    tokens_per_s = n / (time.perf_counter() - start)
    # ~1.5M tokens/s measured on 2 busy cores; a ~5M-param model trains at ~10k tokens/s on CPU.
    # The bound leaves a 10x margin for machine load and still fails on per-token Python loops.
    assert tokens_per_s > 100_000, tokens_per_s


def test_a_dataset_smaller_than_one_step_warns_once_naming_the_sizes(tmp_path, caplog):
    import logging

    # 3 documents of "abcdefgh" = 3 x (BOS + 8 + EOS) = 30 tokens per epoch; a batch of 4 x (15 + 1) = 64.
    (tmp_path / "tiny.jsonl").write_text("".join(json.dumps({"text": "abcdefgh"}) + "\n" for _ in range(3)))
    cfg = TextDataLoader.Config(dataset=str(tmp_path / "tiny.jsonl"), shuffle=False)
    loader = _build(cfg, CharTokenizer(), seq_len=15, batch=4)
    with caplog.at_level(logging.WARNING, logger="torchtitan_lite"):
        _take(loader, 3)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings == [
        f"split 'train' of data.dataset={str(tmp_path / 'tiny.jsonl')!r} gives data-parallel rank 0 30 tokens per "
        f"epoch, fewer than one step reads: training.local_batch_size x (training.seq_len + 1) x 1 local batch(es) "
        f"per step = 4 x 16 x 1 = 64 tokens, so every step repeats the same documents about 2.1 times; add data, or "
        f"lower training.local_batch_size / training.seq_len / training.global_batch_size"]


def test_a_dataset_of_at_least_one_step_does_not_warn(tmp_path, caplog):
    import logging

    (tmp_path / "enough.jsonl").write_text("".join(json.dumps({"text": "abcdefgh"}) + "\n" for _ in range(7)))
    cfg = TextDataLoader.Config(dataset=str(tmp_path / "enough.jsonl"), shuffle=False)
    with caplog.at_level(logging.WARNING, logger="torchtitan_lite"):
        _take(_build(cfg, CharTokenizer(), seq_len=15, batch=4), 4)  # 70 tokens per epoch >= 64
    assert not [r for r in caplog.records if r.levelno == logging.WARNING]
    # With gradient accumulation a step reads several batches: 70 tokens are fewer than 2 x 64.
    with caplog.at_level(logging.WARNING, logger="torchtitan_lite"):
        _take(_build(cfg, CharTokenizer(), seq_len=15, batch=4, batches_per_step=2), 4)
    assert "x 2 local batch(es) per step = 4 x 16 x 2 = 128 tokens" in caplog.text
