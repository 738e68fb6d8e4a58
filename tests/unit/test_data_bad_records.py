"""Bad records in local files: 'error' names file, line and problem; 'skip' counts and leaves them out,
and the loader still resumes exactly. A corpus of only empty documents is an error."""
from __future__ import annotations

import json
import logging

import datasets
import pytest
import torch
from test_data_loader import CharTokenizer, _build, _roundtrip, _take

from torchtitan_lite.components.data import DataSourceError, TextDataLoader
from torchtitan_lite.components.data.sources import load_split


@pytest.fixture(autouse=True)
def isolated_hf_cache(tmp_path, monkeypatch):
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hf-cache"))
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)


GOOD = [json.dumps({"text": f"document number {i} " * 3}).encode() for i in range(12)]
BAD = {
    "invalid JSON": (b'{"text": "unterminated', r"invalid JSON \(Unterminated string starting at, column 10\)"),
    "invalid UTF-8": (b'{"text": "caf\xe9"}', r"invalid UTF-8 at byte 13 of the line"),
    "non-string value": (b'{"text": 5}', r"text=5 is a int, not a string"),
    "missing field": (b'{"body": "x"}', r"no 'text' field \(fields: \['body'\]\)"),
}


def _corpus(tmp_path, bad_line: bytes, at: int = 5):
    lines = GOOD[:at] + [bad_line] + GOOD[at:]
    path = tmp_path / "docs.jsonl"
    path.write_bytes(b"\n".join(lines) + b"\n")
    return path


@pytest.mark.parametrize("reason", sorted(BAD))
def test_bad_record_is_an_error_naming_file_line_and_problem(tmp_path, reason):
    line, text = BAD[reason]
    path = _corpus(tmp_path, line)
    with pytest.raises(DataSourceError, match=rf"{path}:6: {text}.*data\.on_bad_record=skip"):
        load_split(TextDataLoader.Config(dataset=str(path), shuffle=False), "train")


@pytest.mark.parametrize("streaming", [False, True])
@pytest.mark.parametrize("reason", sorted(BAD))
def test_skip_leaves_the_bad_record_out_and_counts_it(tmp_path, reason, streaming, caplog):
    path = _corpus(tmp_path, BAD[reason][0])
    with caplog.at_level(logging.WARNING):
        ds = load_split(TextDataLoader.Config(dataset=str(path), shuffle=False, streaming=streaming,
                                              on_bad_record="skip"), "train")
    assert [r["text"] for r in ds] == [json.loads(g)["text"] for g in GOOD]
    assert f"skipped 1 bad record(s) of data.dataset='{path}' (data.on_bad_record=skip): {reason} 1" in caplog.text
    assert f"{path}:6: " in caplog.text


def test_invalid_utf8_in_a_text_file_both_policies(tmp_path, caplog):
    path = tmp_path / "docs.txt"
    path.write_bytes(b"first line\nsecond \xff line\nthird line\n")
    with pytest.raises(DataSourceError, match=rf"{path}:2: invalid UTF-8 at byte 7 of the line"):
        load_split(TextDataLoader.Config(dataset=str(path), shuffle=False), "train")
    with caplog.at_level(logging.WARNING):
        ds = load_split(TextDataLoader.Config(dataset=str(path), shuffle=False, on_bad_record="skip"), "train")
    assert [r["text"] for r in ds] == ["first line", "third line"]
    assert "invalid UTF-8 1" in caplog.text


@pytest.mark.parametrize("streaming", [False, True])
def test_loader_with_skipped_records_resumes_exactly(tmp_path, streaming):
    lines = []
    for i in range(40):
        lines.append(json.dumps({"text": f"doc {i} " + "abc " * (i % 5)}).encode())
        if i % 7 == 3:
            lines.append(b'{"text": 1}' if i % 2 else b"not json")
    path = tmp_path / "docs.jsonl"
    path.write_bytes(b"\n".join(lines) + b"\n")
    cfg = TextDataLoader.Config(dataset=str(path), streaming=streaming, shuffle=not streaming, on_bad_record="skip")
    make = lambda: _build(cfg, CharTokenizer(), seq_len=9, batch=3, seed=5)  # noqa: E731
    reference = _take(make(), 25)
    for cut in (1, 7, 16):
        loader = make()
        _take(loader, cut)
        resumed = make()
        resumed.load_state_dict(_roundtrip(loader.state_dict()))
        assert all(torch.equal(a[0], b[0]) for a, b in zip(reference[cut:], _take(resumed, 25 - cut), strict=True))


def test_corpus_of_only_empty_documents_is_an_error(tmp_path):
    path = tmp_path / "empty.jsonl"
    path.write_text("".join(json.dumps({"text": ""}) + "\n" for _ in range(10)))
    loader = _build(TextDataLoader.Config(dataset=str(path), shuffle=False), CharTokenizer(), seq_len=4, batch=2)
    with pytest.raises(DataSourceError, match=r"is empty \(only BOS/EOS tokens\); check data\.text_field"):
        _take(loader, 10)
