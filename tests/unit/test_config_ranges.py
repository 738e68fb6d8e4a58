"""Numeric range rules fail when the command line is parsed, before anything is built or written."""
from __future__ import annotations

import pytest

import models  # noqa: F401  (registers the model families)
from config_registry import DEFAULT_REGISTRY
from torchtitan_lite.config import ConfigError, parse_cli


@pytest.mark.parametrize("flag, value, text", [
    ("--training.steps", "-1", "training.steps=-1 must be >= 1"),
    ("--training.seq_len", "0", "training.seq_len=0 must be >= 1"),
    ("--training.local_batch_size", "0", "training.local_batch_size=0 must be >= 1"),
    ("--training.global_batch_size", "0", "training.global_batch_size=0 must be >= 1, or -1"),
    ("--training.max_norm", "-1", "training.max_norm=-1.0 must be >= 0"),
    ("--training.gc_freq", "-5", "training.gc_freq=-5 must be >= 0"),
    ("--parallelism.tp", "0", "parallelism.tp=0 must be >= 1"),
    ("--parallelism.dp_shard", "0", "parallelism.dp_shard=0 must be >= 1, or -1"),
    ("--model.n_layers", "0", "model.n_layers=0 must be >= 1"),
])
def test_out_of_range_values_are_refused_at_parse_time(flag, value, text):
    with pytest.raises(ConfigError, match=rf"invalid value for {flag}: {text}"):
        parse_cli(["--config", "llama3_debug", flag, value], registry=DEFAULT_REGISTRY)


def test_dump_folder_that_is_a_file_is_refused_at_parse_time(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(ConfigError, match=r"job\.dump_folder=.*/file is a file, not a folder"):
        parse_cli(["--config", "llama3_debug", "--job.dump_folder", str(tmp_path / "file")], registry=DEFAULT_REGISTRY)


def test_train_py_writes_nothing_for_a_bad_value(tmp_path):
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    result = subprocess.run([sys.executable, str(root / "train.py"), "--config", "llama3_debug", "--training.steps", "-1",
                             "--job.dump_folder", str(tmp_path / "run")], capture_output=True, text=True, timeout=300)
    assert result.returncode == 2 and "training.steps=-1 must be >= 1" in result.stderr
    assert not (tmp_path / "run").exists()
