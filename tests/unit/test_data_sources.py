import gzip
import json

import datasets
import pytest
from datasets import Dataset, DatasetDict, IterableDataset

from torchtitan_lite.components.data import DataSourceError, TextDataLoader
from torchtitan_lite.components.data.corpus import embedded_corpus
from torchtitan_lite.components.data.sources import load_split

DOCS = ["def f():\n    return 1\n", "héllo wörld", "x = [i for i in range(3)]", "line one, line two", "last"]


@pytest.fixture(autouse=True)
def isolated_hf_cache(tmp_path, monkeypatch):
    """Arrow caches of the test files go to the test's tmp dir, and nothing may reach the network."""
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hf-cache"))
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)


def _texts(ds, field="text"):
    return [record[field] for record in ds]


def _write(path, docs, fmt, field="text"):
    path.parent.mkdir(parents=True, exist_ok=True)
    if fmt == "jsonl":
        path.write_text("".join(json.dumps({field: d, "id": i}) + "\n" for i, d in enumerate(docs)))
    elif fmt == "json":
        path.write_text(json.dumps([{field: d, "id": i} for i, d in enumerate(docs)]))
    elif fmt == "parquet":
        Dataset.from_dict({field: docs, "id": list(range(len(docs)))}).to_parquet(str(path))
    elif fmt == "csv":
        Dataset.from_dict({field: docs, "id": list(range(len(docs)))}).to_csv(str(path), index=False)
    elif fmt == "text":
        path.write_text("\n".join(docs) + "\n")
    return path


def _cfg(**kw):
    return TextDataLoader.Config(shuffle="none", **kw)


@pytest.mark.parametrize("fmt,ext", [("jsonl", "jsonl"), ("json", "json"), ("parquet", "parquet"), ("csv", "csv")])
@pytest.mark.parametrize("streaming", [False, True])
def test_local_formats_are_inferred_from_the_extension(tmp_path, fmt, ext, streaming):
    path = _write(tmp_path / f"docs.{ext}", DOCS, fmt)
    ds = load_split(_cfg(dataset=str(path), streaming=streaming), "train")
    assert isinstance(ds, IterableDataset if streaming else Dataset)
    # A streamed JSON array has no schema up front: its records keep every field, and the loader reads the
    # text field of each (one without it is a bad record, see test_data_bad_records.py).
    fields = ["text", "id"] if streaming and fmt == "json" else ["text"]
    assert [list(record) for record in ds] == [fields] * len(DOCS) and _texts(ds) == DOCS


def test_text_files_hold_one_document_per_line(tmp_path):
    path = _write(tmp_path / "docs.txt", ["first doc", "second doc"], "text")
    assert _texts(load_split(_cfg(dataset=str(path)), "train")) == ["first doc", "second doc"]


def test_glob_reads_every_match_in_sorted_order(tmp_path):
    _write(tmp_path / "b" / "part-1.jsonl", DOCS[3:], "jsonl")
    _write(tmp_path / "a" / "part-0.jsonl", DOCS[:3], "jsonl")
    _write(tmp_path / "a" / "ignored.txt", ["not json"], "text")
    ds = load_split(_cfg(dataset=str(tmp_path / "**" / "*.jsonl")), "train")
    assert _texts(ds) == DOCS


def test_explicit_format_overrides_the_extension_and_compression_is_seen_through(tmp_path):
    plain = _write(tmp_path / "docs.data", DOCS, "jsonl")
    assert _texts(load_split(_cfg(dataset=str(plain), data_format="jsonl"), "train")) == DOCS
    packed = tmp_path / "docs.jsonl.gz"
    packed.write_bytes(gzip.compress(plain.read_bytes()))
    assert _texts(load_split(_cfg(dataset=str(packed)), "train")) == DOCS


def test_custom_text_field_keeps_only_that_column(tmp_path):
    path = _write(tmp_path / "docs.jsonl", DOCS, "jsonl", field="content")
    ds = load_split(_cfg(dataset=str(path), text_field="content"), "train")
    assert ds.column_names == ["content"] and _texts(ds, "content") == DOCS


def test_validation_files_supply_the_validation_split(tmp_path):
    train = _write(tmp_path / "train.jsonl", DOCS, "jsonl")
    val = _write(tmp_path / "val" / "v.parquet", DOCS[:2], "parquet")
    cfg = _cfg(dataset=str(train), validation_files=str(tmp_path / "val" / "*.parquet"))
    assert _texts(load_split(cfg, "validation")) == DOCS[:2]
    assert _texts(load_split(cfg, "train")) == DOCS
    assert val.exists()


def test_embedded_corpus_loads_through_datasets():
    corpus = embedded_corpus()
    train, validation = load_split(_cfg(), "train"), load_split(_cfg(), "validation")
    assert (len(train), len(validation)) == (corpus.train_documents, corpus.validation_documents)
    assert train.column_names == ["text"] and train[0]["text"].strip()


def _repo_folder(tmp_path):
    """A script-free dataset folder laid out like a hub repository."""
    root = tmp_path / "my_dataset"
    _write(root / "data" / "train-00000-of-00001.jsonl", DOCS, "jsonl")
    _write(root / "data" / "validation-00000-of-00001.jsonl", DOCS[:2], "jsonl")
    return root


@pytest.mark.parametrize("streaming", [False, True])
def test_dataset_folder_is_loaded_like_a_hub_repository(tmp_path, streaming):
    cfg = _cfg(dataset=str(_repo_folder(tmp_path)), streaming=streaming)
    assert _texts(load_split(cfg, "train")) == DOCS
    assert _texts(load_split(cfg, "validation")) == DOCS[:2]


def test_dataset_folder_with_explicit_format(tmp_path):
    cfg = _cfg(dataset=str(_repo_folder(tmp_path)), data_format="json")
    assert _texts(load_split(cfg, "validation")) == DOCS[:2]


def test_unknown_split_of_a_dataset_folder_names_the_split(tmp_path):
    cfg = _cfg(dataset=str(_repo_folder(tmp_path)), validation_split="dev")
    with pytest.raises(DataSourceError, match=r"could not load data.dataset='.*my_dataset' \(split 'dev'\).*dev"):
        load_split(cfg, "validation")


@pytest.mark.parametrize("streaming", [False, True])
def test_save_to_disk_folder(tmp_path, streaming):
    DatasetDict({"train": Dataset.from_dict({"text": DOCS}), "validation": Dataset.from_dict({"text": DOCS[:1]})}
                ).save_to_disk(str(tmp_path / "saved"))
    cfg = _cfg(dataset=str(tmp_path / "saved"), streaming=streaming)
    assert _texts(load_split(cfg, "train")) == DOCS and _texts(load_split(cfg, "validation")) == DOCS[:1]
    with pytest.raises(DataSourceError, match=r"has splits \['train', 'validation'\], not 'test'"):
        load_split(_cfg(dataset=str(tmp_path / "saved"), validation_split="test"), "validation")


def test_save_to_disk_single_dataset_is_the_train_split(tmp_path):
    Dataset.from_dict({"text": DOCS}).save_to_disk(str(tmp_path / "one"))
    assert _texts(load_split(_cfg(dataset=str(tmp_path / "one")), "train")) == DOCS
    with pytest.raises(DataSourceError, match="holds a single dataset without splits.*set data.validation_files"):
        load_split(_cfg(dataset=str(tmp_path / "one")), "validation")


def test_hub_name_unavailable_offline_says_so():
    with pytest.raises(DataSourceError, match=r"could not load hub dataset data.dataset='someone/no-such-dataset' "
                                              r"\(split 'train'\).*must already be in the Hugging Face cache"):
        load_split(_cfg(dataset="someone/no-such-dataset"), "train")


# --------------------------------------------------------------------------------------------------
# Broken data


def test_glob_matching_nothing(tmp_path):
    with pytest.raises(DataSourceError, match=r"data.dataset='.*/\*.jsonl' matches no files .*check the path"):
        load_split(_cfg(dataset=str(tmp_path / "*.jsonl")), "train")


def test_missing_file_is_not_mistaken_for_a_hub_name():
    with pytest.raises(DataSourceError, match=r"data.dataset='./missing/docs.jsonl' matches no files"):
        load_split(_cfg(dataset="./missing/docs.jsonl"), "train")


def test_missing_validation_files(tmp_path):
    train = _write(tmp_path / "train.jsonl", DOCS, "jsonl")
    with pytest.raises(DataSourceError, match=r"data.validation_files='.*val.jsonl' matches no files"):
        load_split(_cfg(dataset=str(train), validation_files=str(tmp_path / "val.jsonl")), "validation")


def test_file_dataset_without_validation_files(tmp_path):
    train = _write(tmp_path / "train.jsonl", DOCS, "jsonl")
    with pytest.raises(DataSourceError, match=r"is a file or glob, which has no validation split \(validation.enable "
                                              r"is on\); set --data.validation_files FILE .* or --validation.enable "
                                              r"false"):
        load_split(_cfg(dataset=str(train)), "validation")


def test_validation_files_beside_a_hub_dataset_with_a_configuration(tmp_path):
    """data.dataset_config selects a configuration of data.dataset; held-out files need no second flag."""
    val = _write(tmp_path / "val.jsonl", DOCS, "jsonl")
    cfg = _cfg(dataset="HuggingFaceFW/fineweb-edu", dataset_config="sample-10BT", validation_files=str(val))
    assert load_split(cfg, "validation")["text"] == DOCS


@pytest.mark.parametrize("streaming", [False, True])
def test_empty_dataset(tmp_path, streaming):
    path = tmp_path / "empty.parquet"
    Dataset.from_dict({"text": []}, features=datasets.Features({"text": datasets.Value("string")})).to_parquet(str(path))
    with pytest.raises(DataSourceError, match=r"data.dataset='.*empty.parquet' .*\(split 'train'\) has no "
                                              r"documents; add data"):
        load_split(_cfg(dataset=str(path), streaming=streaming), "train")


@pytest.mark.parametrize("streaming", [False, True])
def test_missing_text_field_lists_the_fields(tmp_path, streaming):
    path = _write(tmp_path / "docs.jsonl", DOCS, "jsonl", field="body")
    with pytest.raises(DataSourceError,
                       match=r"docs\.jsonl:1: no 'text' field \(fields: \['body', 'id'\]\) .*point data\.text_field"):
        load_split(_cfg(dataset=str(path), streaming=streaming), "train")


def test_non_string_text_field(tmp_path):
    path = _write(tmp_path / "docs.jsonl", DOCS, "jsonl")
    with pytest.raises(DataSourceError, match=r"docs\.jsonl:1: id=0 is a int, not a string .*point data\.text_field"):
        load_split(_cfg(dataset=str(path), text_field="id"), "train")


def test_malformed_file_names_the_source(tmp_path):
    path = tmp_path / "broken.jsonl"
    path.write_text('{"text": "ok"}\n{"text": \n')
    with pytest.raises(DataSourceError, match=r"broken\.jsonl:2: invalid JSON \(Expecting value, column 10\)"):
        load_split(_cfg(dataset=str(path)), "train")


def test_unknown_and_mixed_extensions(tmp_path):
    odd = _write(tmp_path / "docs.dat", DOCS, "jsonl")
    with pytest.raises(DataSourceError, match=r"cannot infer the format .* \['.dat'\]; set data.data_format"):
        load_split(_cfg(dataset=str(odd)), "train")
    _write(tmp_path / "more.jsonl", DOCS, "jsonl")
    with pytest.raises(DataSourceError, match=r"\['.dat', '.jsonl'\]"):
        load_split(_cfg(dataset=str(tmp_path / "*")), "train")


def test_options_that_do_not_apply_are_rejected(tmp_path):
    path = _write(tmp_path / "docs.jsonl", DOCS, "jsonl")
    with pytest.raises(DataSourceError, match="data.dataset_config='en' selects a configuration .* leave it unset"):
        load_split(_cfg(dataset=str(path), dataset_config="en"), "train")
    with pytest.raises(DataSourceError, match="data.data_format='csv' does not apply to the embedded corpus"):
        load_split(_cfg(data_format="csv"), "train")
    with pytest.raises(DataSourceError, match="data.data_format='parquet' applies to local files"):
        load_split(_cfg(dataset="someone/dataset", data_format="parquet"), "train")


def test_config_rejects_shuffling_a_stream():
    with pytest.raises(ValueError, match="data.shuffle='windows' needs a random-access source, but "
                                         "data.streaming=true.*set data.shuffle=none"):
        TextDataLoader.Config(streaming=True)


@pytest.mark.parametrize("old,hint", [(True, "true read the documents in a shuffled order: 'documents'"),
                                      (False, "false: 'none'"), ("random", "")])
def test_config_refuses_an_order_it_does_not_know_naming_the_orders(old, hint):
    # data.shuffle was a bool: a config still written that way is told what its value is called now.
    with pytest.raises(ValueError, match=rf"data.shuffle={old!r} is not an order; use one of windows, documents, "
                                         rf"none.*{hint}"):
        TextDataLoader.Config(shuffle=old)


@pytest.mark.parametrize("role", ["train", "validation"])
def test_an_empty_file_is_refused_by_name_not_with_a_bare_stop_iteration(tmp_path, role):
    from torchtitan_lite.components.data.readiness import data_problems
    from torchtitan_lite.components.tokenizer import Tokenizer

    empty = tmp_path / "data" / "empty.jsonl"
    empty.parent.mkdir()
    empty.write_bytes(b"")
    full = _write(tmp_path / "data" / "full.jsonl", DOCS, "jsonl")
    cfg = (TextDataLoader.Config(dataset=str(empty)) if role == "train"
           else TextDataLoader.Config(dataset=str(full), validation_files=str(empty)))
    option = "data.dataset" if role == "train" else "data.validation_files"
    message = (f"{option}={str(empty)!r}: {empty} is empty (0 bytes), so it holds no documents; write the data into "
               f"it or leave it out of the path or glob")
    with pytest.raises(DataSourceError) as error:
        load_split(cfg, role)
    assert str(error.value) == message
    assert message in data_problems(cfg, Tokenizer.Config(), validation=role == "validation")  # before launch
