"""Bad records in local files: 'error' names file, line and problem; 'skip' counts and leaves them out,
and the loader still resumes exactly. A corpus of only empty documents is an error."""
from __future__ import annotations

import json
import logging

import datasets
import pytest
import torch
from test_data_loader import BOS, EOS, OFFSET, CharTokenizer, _build, _roundtrip, _take

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
        load_split(TextDataLoader.Config(dataset=str(path), shuffle="none"), "train")


@pytest.mark.parametrize("streaming", [False, True])
@pytest.mark.parametrize("reason", sorted(BAD))
def test_skip_leaves_the_bad_record_out_and_counts_it(tmp_path, reason, streaming, caplog):
    path = _corpus(tmp_path, BAD[reason][0])
    with caplog.at_level(logging.WARNING):
        ds = load_split(TextDataLoader.Config(dataset=str(path), shuffle="none", streaming=streaming,
                                              on_bad_record="skip"), "train")
    assert [r["text"] for r in ds] == [json.loads(g)["text"] for g in GOOD]
    assert f"skipped 1 bad record(s) of data.dataset='{path}' (data.on_bad_record=skip): {reason} 1" in caplog.text
    assert f"{path}:6: " in caplog.text


def test_invalid_utf8_in_a_text_file_both_policies(tmp_path, caplog):
    path = tmp_path / "docs.txt"
    path.write_bytes(b"first line\nsecond \xff line\nthird line\n")
    with pytest.raises(DataSourceError, match=rf"{path}:2: invalid UTF-8 at byte 7 of the line"):
        load_split(TextDataLoader.Config(dataset=str(path), shuffle="none"), "train")
    with caplog.at_level(logging.WARNING):
        ds = load_split(TextDataLoader.Config(dataset=str(path), shuffle="none", on_bad_record="skip"), "train")
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
    cfg = TextDataLoader.Config(dataset=str(path), streaming=streaming, shuffle="none" if streaming else "windows",
                                on_bad_record="skip")
    make = lambda: _build(cfg, CharTokenizer(), seq_len=9, batch=3, seed=5)  # noqa: E731
    reference = _take(make(), 25)
    for cut in (1, 7, 16):
        loader = make()
        _take(loader, cut)
        resumed = make()
        resumed.load_state_dict(_roundtrip(loader.state_dict()))
        assert all(torch.equal(a[0], b[0]) for a, b in zip(reference[cut:], _take(resumed, 25 - cut), strict=True))


@pytest.mark.parametrize("policy", ["error", "skip"])
def test_corpus_of_only_empty_documents_is_an_error(tmp_path, policy):
    # Empty documents are valid records, so skipping bad records does not hide a corpus that trains on nothing.
    path = tmp_path / "empty.jsonl"
    path.write_text("".join(json.dumps({"text": ""}) + "\n" for _ in range(10)))
    for streaming in (False, True):
        cfg = TextDataLoader.Config(dataset=str(path), shuffle="none", on_bad_record=policy, streaming=streaming)
        with pytest.raises(DataSourceError, match=r"is empty \(only BOS/EOS tokens\); check data\.text_field"):
            _take(_build(cfg, CharTokenizer(), seq_len=4, batch=2), 10)


def _assert_skipped(pattern, texts: list[str], counted: str, caplog) -> None:
    """With data.on_bad_record=skip, map-style and streamed, ``pattern`` reads as ``texts`` and the log counts."""
    for streaming in (False, True):
        caplog.clear()
        with caplog.at_level(logging.WARNING):
            ds = load_split(TextDataLoader.Config(dataset=str(pattern), shuffle="none", streaming=streaming,
                                                  on_bad_record="skip"), "train")
        assert [r["text"] for r in ds] == texts
        assert counted in caplog.text


# --------------------------------------------------------------------------------------------------
# Compressed JSON lines


@pytest.mark.parametrize("codec", ["gz", "bz2", "xz"])
def test_compressed_json_lines_are_scanned_under_both_policies(tmp_path, codec, caplog):
    import bz2
    import gzip
    import lzma

    raw = b"\n".join(GOOD[:5] + [BAD["non-string value"][0]] + GOOD[5:]) + b"\n"
    path = tmp_path / f"docs.jsonl.{codec}"
    path.write_bytes({"gz": gzip.compress, "bz2": bz2.compress, "xz": lzma.compress}[codec](raw))
    with pytest.raises(DataSourceError, match=rf"{path}:6: text=5 is a int, not a string"):
        load_split(TextDataLoader.Config(dataset=str(path), shuffle="none"), "train")
    _assert_skipped(path, [json.loads(g)["text"] for g in GOOD], "non-string value 1", caplog)


@pytest.mark.parametrize(("suffix", "module", "package"), [("zst", "zstandard", "zstandard"),
                                                         ("lz4", "lz4.frame", "lz4")])
def test_a_codec_without_its_package_names_the_package(tmp_path, monkeypatch, suffix, module, package):
    import sys

    # A None entry makes `import package` raise ImportError, installed or not: the case a user without it hits.
    monkeypatch.setitem(sys.modules, module, None)
    path = tmp_path / f"docs.jsonl.{suffix}"
    path.write_bytes(b"\x28\xb5\x2f\xfd not really compressed")
    with pytest.raises(DataSourceError, match=rf"{path}: reading \.{suffix} files needs the {package} package"):
        load_split(TextDataLoader.Config(dataset=str(path), shuffle="none"), "train")


# --------------------------------------------------------------------------------------------------
# CSV

CSV_GOOD = [b'1,first document', b'2,"quoted, with a comma"', b'3,"two\nlines"', b'4,NA', b'5,12345']
CSV_BAD = {
    "null value": (b"9,", r"the 'text' cell is empty \(CSV's null\)"),
    "malformed row": (b"9,x,y", r"3 fields, the header has 2"),
    "invalid UTF-8": (b"9,caf\xe9", r"invalid UTF-8 in the row"),
}
CSV_TEXTS = ["first document", "quoted, with a comma", "two\nlines", "NA", "12345"]
"""Every cell of the text column is text: 'NA' and '12345' are documents."""


def _csv(tmp_path, bad_row: bytes | None = None, header: bytes = b"id,text"):
    rows = CSV_GOOD[:3] + ([bad_row] if bad_row is not None else []) + CSV_GOOD[3:]
    path = tmp_path / "docs.csv"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"\n".join([header, *rows]) + b"\n")
    return path


def test_clean_csv_reads_the_same_through_datasets_and_the_record_reader(tmp_path):
    from torchtitan_lite.components.data import records

    path = _csv(tmp_path)
    ds = load_split(TextDataLoader.Config(dataset=str(path), shuffle="none"), "train")
    assert [r["text"] for r in ds] == CSV_TEXTS
    assert [r["text"] for r in records.good_records([str(path)], "csv", "text", [])] == CSV_TEXTS


@pytest.mark.parametrize("reason", sorted(CSV_BAD))
def test_bad_csv_row_both_policies(tmp_path, reason, caplog):
    row, text = CSV_BAD[reason]
    path = _csv(tmp_path, row)
    # Line 6: the header, three rows (one spans two lines), then the bad one.
    with pytest.raises(DataSourceError, match=rf"{path}:6: {text} \(data\.dataset=.*data\.on_bad_record=skip"):
        load_split(TextDataLoader.Config(dataset=str(path), shuffle="none"), "train")
    _assert_skipped(path, CSV_TEXTS, f"{reason} 1", caplog)
    assert f"{path}:6: " in caplog.text


def test_csv_without_the_text_column_both_policies(tmp_path, caplog):
    path = _csv(tmp_path, header=b"id,body")
    with pytest.raises(DataSourceError, match=rf"{path}:2: the header has no 'text' column \(columns: \['id', "
                                              rf"'body'\]\); all 5 rows of {path} .*point data\.text_field"):
        load_split(TextDataLoader.Config(dataset=str(path), shuffle="none"), "train")
    good = _csv(tmp_path / "good")
    with caplog.at_level(logging.WARNING):
        ds = load_split(TextDataLoader.Config(dataset=str(tmp_path / "**" / "*.csv"), shuffle="none",
                                              on_bad_record="skip"), "train")
    assert [r["text"] for r in ds] == CSV_TEXTS and good.exists()
    assert "skipped 5 bad record(s)" in caplog.text and "missing column 5" in caplog.text


# --------------------------------------------------------------------------------------------------
# Parquet


def _parquet(path, columns: dict, row_group_size: int = 4):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table(columns), str(path), row_group_size=row_group_size)
    return path


PARQUET_TEXTS = [f"parquet document {i}" for i in range(11)]


def test_parquet_bad_records_both_policies(tmp_path, caplog):
    # A null in the second row group, a file without the column, a file whose column holds integers.
    nulls = _parquet(tmp_path / "a.parquet", {"text": PARQUET_TEXTS[:5] + [None] + PARQUET_TEXTS[5:]})
    no_column = _parquet(tmp_path / "b.parquet", {"body": ["x", "y", "z"]})
    ints = _parquet(tmp_path / "c.parquet", {"text": [1, 2]})
    errors = {nulls: r"row 5: text is null", no_column: r"row 0: no 'text' column \(columns: \['body'\]\); all 3 rows",
              ints: r"row 0: column 'text' holds int64, not strings; all 2 rows"}
    for path, text in errors.items():
        with pytest.raises(DataSourceError, match=rf"{path} {text}.*data\.on_bad_record=skip"):
            load_split(TextDataLoader.Config(dataset=str(path), shuffle="none"), "train")
    _assert_skipped(tmp_path / "*.parquet", PARQUET_TEXTS,
                    "skipped 6 bad record(s) of data.dataset='{}' (data.on_bad_record=skip): missing column 3, "
                    "non-string value 2, null value 1".format(tmp_path / "*.parquet"), caplog)


def test_clean_parquet_files_may_differ_in_their_other_columns(tmp_path):
    _parquet(tmp_path / "a.parquet", {"text": PARQUET_TEXTS[:6], "id": list(range(6))})
    _parquet(tmp_path / "b.parquet", {"text": PARQUET_TEXTS[6:], "url": ["u"] * 5})
    ds = load_split(TextDataLoader.Config(dataset=str(tmp_path / "*.parquet"), shuffle="none"), "train")
    assert [r["text"] for r in ds] == PARQUET_TEXTS  # only the text column is read


# --------------------------------------------------------------------------------------------------
# Sources read as they are: dataset folders (and so hub datasets), streamed or not

MIXED = [{"text": "first"}, {"body": "no text field"}, {"text": 5}, {"text": None}, {"text": "last"}]


def _folder(tmp_path):
    folder = tmp_path / "corpus"
    folder.mkdir()
    (folder / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in MIXED))
    return folder


@pytest.mark.parametrize("streaming, schemaless, where, problem", [
    (False, False, r"row 1 of split 'train' of data\.dataset='.*corpus'", r"has text=None \(null\)"),
    (True, False, r"record 1 of data-parallel rank 0's stream of split 'train' of data\.dataset='.*corpus', "
                  r"shard 0 \(fields \['text'\]\)", r"has text=None \(null\)"),
    (True, True, r"record 1 of data-parallel rank 0's stream of split 'train' of data\.dataset='.*corpus', "
                 r"shard 0 \(fields \['body'\]\)", r"has no 'text' field"),
])
def test_a_bad_record_of_a_read_source_is_named(tmp_path, streaming, schemaless, where, problem):
    cfg = TextDataLoader.Config(dataset=str(_folder(tmp_path)), shuffle="none", streaming=streaming)
    # A stream finds it when it reads the record; a random-access source when it is tokenised into its store.
    with pytest.raises(DataSourceError, match=rf"{where} {problem}.*; fix the record.* data\.on_bad_record=skip"):
        loader = _build(cfg, CharTokenizer(), seq_len=3, batch=1)
        if schemaless:  # a stream whose schema is known only from its records (a hub stream of JSON records)
            loader.documents = datasets.IterableDataset.from_generator(lambda: iter(MIXED))
        _take(loader, 1)


@pytest.mark.parametrize("streaming", [False, True])
def test_skipped_records_of_a_read_source_are_counted_and_resume_exactly(tmp_path, streaming, caplog):
    cfg = TextDataLoader.Config(dataset=str(_folder(tmp_path)), shuffle="none", streaming=streaming,
                                on_bad_record="skip")
    make = lambda: _build(cfg, CharTokenizer(), seq_len=3, batch=1)  # noqa: E731
    with caplog.at_level(logging.WARNING):
        reference = _take(make(), 6)
    stream = [t for inputs, labels in reference for t in inputs[0].tolist() + labels[0].tolist()[-1:]]
    text = "".join("<" if t == BOS else ">" if t == EOS else chr(t - OFFSET) for t in stream)
    # Only the good documents, epoch after epoch (a store's epoch drops the tail that fills no window).
    assert text == ("<first><last><first><last>"[:24] if streaming else "<first><last" * 2)
    assert "skipped 3 bad record(s)" in caplog.text and "non-string value 1" in caplog.text
    loader = make()
    _take(loader, 4)
    state = _roundtrip(loader.state_dict())
    if streaming:
        assert state["bad_records"] == {"null value": 4, "non-string value": 2}  # counted again in each epoch
    else:  # left out of the store once, when it is written
        assert loader.store.index["source"]["skipped_records"] == {"null value": 2, "non-string value": 1}
    resumed = make()
    resumed.load_state_dict(state)
    assert all(torch.equal(a[0], b[0]) for a, b in zip(reference[4:], _take(resumed, 2), strict=True))
