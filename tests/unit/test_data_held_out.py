"""Validation files must not be among the training files: the README's own example once validated on a file
its training glob also read."""
import json
import re
from pathlib import Path

import pytest

from torchtitan_lite.components.data import DataSourceError, TextDataLoader
from torchtitan_lite.components.data.readiness import data_problems
from torchtitan_lite.components.data.sources import check_held_out
from torchtitan_lite.components.tokenizer import Tokenizer


def _jsonl(path, docs):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))


@pytest.fixture
def data_dir(tmp_path, monkeypatch):
    for name in ("train-0.jsonl", "train-1.jsonl", "val.jsonl"):
        _jsonl(tmp_path / "data" / name, [f"document of {name}"])
    monkeypatch.chdir(tmp_path)
    return tmp_path / "data"


def test_a_validation_file_inside_the_training_glob_is_refused_naming_it_and_the_fix(data_dir):
    cfg = TextDataLoader.Config(dataset="data/*.jsonl", validation_files="data/val.jsonl")
    with pytest.raises(DataSourceError) as error:
        check_held_out(cfg)
    message = str(error.value)
    assert "\n" not in message
    assert "data.validation_files='data/val.jsonl' and data.dataset='data/*.jsonl' both name data/val.jsonl" in message
    assert "narrow data.dataset to the training files (e.g. 'data/train-*.jsonl')" in message
    # --check-config (and run_train.sh's check before launch) reports it with the other data problems.
    problems = data_problems(cfg, Tokenizer.Config(), validation=True)
    assert [p for p in problems if "both name data/val.jsonl" in p]


def test_the_same_file_by_another_path_is_an_overlap(data_dir):
    cfg = TextDataLoader.Config(dataset="data/*.jsonl", validation_files=str(data_dir / "." / "val.jsonl"))
    with pytest.raises(DataSourceError, match="both name"):
        check_held_out(cfg)


def test_held_out_files_pass(data_dir):
    cfg = TextDataLoader.Config(dataset="data/train-*.jsonl", validation_files="data/val.jsonl")
    check_held_out(cfg)
    assert data_problems(cfg, Tokenizer.Config(), validation=True) == []


def test_the_readme_validation_example_holds_its_validation_file_out(data_dir):
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    examples = re.findall(r"--data\.dataset '([^']+)' --data\.validation_files (\S+)", readme)
    assert examples, "README shows how to validate on held-out files"
    for dataset, validation_files in examples:
        check_held_out(TextDataLoader.Config(dataset=dataset, validation_files=validation_files))
