import json

import datasets
import numpy as np
import pytest
import torch
from _char_tokenizer import BOS, EOS, OFFSET, CharTokenizer

from torchtitan_lite.components.data import TextDataLoader
from torchtitan_lite.components.data.batch import to_batch
from torchtitan_lite.components.data.packing import append_documents, cut_windows, empty_buffer


@pytest.fixture(autouse=True)
def isolated_hf_cache(tmp_path, monkeypatch):
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hf-cache"))


def _docs(n=23):
    # Lengths 1..n+ so documents straddle window boundaries in every possible way.
    return [f"d{i}:" + "abcdefg"[i % 7] * (i % 11) for i in range(n)]


def _jsonl(tmp_path, docs):
    path = tmp_path / "docs.jsonl"
    path.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    return str(path)


def _stream(docs):
    return [t for ids in CharTokenizer().encode_batch(docs) for t in ids]


def _loader(path, seq_len=7, batch=3, **kw):
    cfg = TextDataLoader.Config(dataset=path, shuffle=kw.pop("shuffle", "none"), streaming=kw.pop("streaming", False))
    return cfg.build(tokenizer=kw.pop("tokenizer", CharTokenizer()), dp_rank=kw.pop("dp_rank", 0),
                     dp_world_size=kw.pop("dp_world_size", 1), seq_len=seq_len, local_batch_size=batch, **kw)


def _text(tokens, bos, eos):
    return "".join(bos if t == BOS else eos if t == EOS else chr(t - OFFSET) for t in tokens)


def _windows(batches):
    """Rebuild the seq_len + 1 windows: inputs plus the last label."""
    return [torch.cat([x, y[-1:]]).tolist() for inputs, labels in batches for x, y in zip(inputs, labels)]


def test_buffer_helpers():
    buffer = append_documents(empty_buffer(), [[1, 5, 6, 2], [1, 7, 2]])
    buffer = append_documents(buffer, [[1, 8, 2]])
    assert buffer.tolist() == [1, 5, 6, 2, 1, 7, 2, 1, 8, 2] and buffer.dtype == np.int32
    windows, rest = cut_windows(buffer, 2, 4)
    assert windows.tolist() == [[1, 5, 6, 2], [1, 7, 2, 1]] and rest.tolist() == [8, 2]
    inputs, labels = batch = to_batch(windows, [np.array([0]), np.array([0])])
    assert inputs.tolist() == [[1, 5, 6], [1, 7, 2]] and labels.tolist() == [[5, 6, 2], [7, 2, 1]]
    assert [s.tolist() for s in batch.doc_starts] == [[0], [0]]
    assert inputs.dtype == labels.dtype == torch.int64 and inputs.is_contiguous() and labels.is_contiguous()
    with pytest.raises(ValueError, match="3 windows of 4 tokens need 12 tokens, the buffer has 10"):
        cut_windows(buffer, 3, 4)


@pytest.mark.parametrize("streaming", [False, True])
def test_finite_pass_packs_the_exact_token_stream(tmp_path, streaming):
    docs = _docs()
    batches = list(_loader(_jsonl(tmp_path, docs), seq_len=7, batch=3, infinite=False, streaming=streaming))
    stream = _stream(docs)
    n_windows = len(stream) // 8
    # Consecutive non-overlapping windows of seq_len + 1 tokens; the final partial window is dropped.
    assert _windows(batches) == [stream[k * 8:(k + 1) * 8] for k in range(n_windows)]
    assert [b[0].shape[0] for b in batches] == [3] * (n_windows // 3) + ([n_windows % 3] if n_windows % 3 else [])
    for inputs, labels in batches:
        assert inputs.shape[1] == labels.shape[1] == 7 and inputs.dtype == torch.int64
        assert torch.equal(labels[:, :-1], inputs[:, 1:])  # labels are the inputs shifted by one


def test_documents_sit_between_bos_and_eos(tmp_path):
    docs = _docs()
    tokens = [t for w in _windows(_loader(_jsonl(tmp_path, docs), infinite=False)) for t in w]
    text = _text(tokens, "<s>", "</s>")
    assert text.startswith("<s>d0:</s><s>d1:b</s><s>d2:cc</s>")
    assert text.count("<s>") - text.count("</s>") in (0, 1)


def test_an_infinite_stream_starts_the_next_epoch_right_after_the_last_document(tmp_path):
    docs = _docs(5)
    loader = _loader(_jsonl(tmp_path, docs), seq_len=5, batch=2, streaming=True)
    it = iter(loader)
    stream = _stream(docs) * 20
    got = [t for w in _windows(next(it) for _ in range(15)) for t in w]
    assert got == stream[:len(got)] and loader.state_dict()["epoch"] > 2


def test_every_epoch_of_a_store_reads_its_full_windows_and_drops_the_tail(tmp_path):
    docs = _docs(5)
    loader = _loader(_jsonl(tmp_path, docs), seq_len=5, batch=2)
    stream = _stream(docs)
    per_epoch = [stream[k * 6:(k + 1) * 6] for k in range(len(stream) // 6)]
    assert len(stream) % 6 and loader.n_windows == len(per_epoch)
    it = iter(loader)
    got = _windows(next(it) for _ in range(len(per_epoch) * 3 // 2))
    assert got == (per_epoch * 3)[:len(got)]


def test_shuffle_draws_a_new_seeded_order_every_epoch(tmp_path):
    docs = _docs(40)
    path = _jsonl(tmp_path, docs)

    def epochs(seed, n=2):
        loader = _loader(path, seq_len=15, batch=1, shuffle="documents", seed=seed)
        it, tokens = iter(loader), []
        while loader.state_dict()["consumed"] < n * loader.n_windows:
            tokens += _windows([next(it)])[0]
        text = _text(tokens, "<", ">")
        order = [d for d in text.replace("<", "").split(">") if d.startswith("d") and d in docs]
        return order[:35], order[40:75]

    first, second = epochs(0)
    assert first != [d for d in docs[:35]] and first != second
    assert epochs(0) == (first, second) and epochs(1)[0] != first


def test_validation_split_is_never_shuffled(tmp_path):
    docs = _docs()
    path = _jsonl(tmp_path, docs)
    held_out = tmp_path / "held_out"
    held_out.mkdir()
    validation = _jsonl(held_out, docs)  # the same documents in a file of its own: validation files are held out
    cfg = TextDataLoader.Config(dataset=path, validation_files=validation, shuffle="windows")
    loader = cfg.build(tokenizer=CharTokenizer(), dp_rank=0, dp_world_size=1, seq_len=7, local_batch_size=3,
                       split="validation", infinite=False, seed=0)
    stream = _stream(docs)
    assert _windows(loader) == [stream[k * 8:(k + 1) * 8] for k in range(len(stream) // 8)]


def test_real_tokenizer_windows_decode_to_the_documents(tmp_path):
    from torchtitan_lite.components.tokenizer import Tokenizer

    tokenizer = Tokenizer.Config().build()
    docs = ['print("hello")\n', "x = {'a': 1}\n\n", "# ünïcode 🤖\n"]
    loader = _loader(_jsonl(tmp_path, docs * 4), seq_len=16, batch=2, tokenizer=tokenizer, infinite=False)
    tokens = [t for w in _windows(loader) for t in w]
    ids = [tokenizer.encode(d) for d in docs * 4]
    flat = [t for doc in ids for t in doc]
    assert tokens == flat[:len(tokens)] and len(flat) - len(tokens) < 17
    assert tokens[0] == tokenizer.bos_id and tokens[len(ids[0]) - 1] == tokenizer.eos_id
    assert tokenizer.decode(tokens[:len(ids[0])]) == docs[0]
