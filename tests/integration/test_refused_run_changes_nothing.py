"""A run that is refused leaves every byte of its dump folder as it was.

The folder of a finished run (config.toml, TensorBoard events, two checkpoints) is the starting point;
each case starts train.py's main in this process with something that must be refused, and compares a
digest of every file and folder under the dump folder before and after.
"""
from __future__ import annotations

import json
import logging
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from _tree_digest import tree_digest  # noqa: E402

import train  # noqa: E402

TINY = ["--config", "llama3_debug", "--model.n_layers", "2", "--training.seq_len", "32",
        "--training.local_batch_size", "2", "--validation.enable", "false", "--metrics.log_freq", "1",
        "--metrics.cpu_peak_tflops", "1", "--checkpoint.enable", "true", "--checkpoint.interval", "1"]


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory) -> Path:
    dump = tmp_path_factory.mktemp("finished") / "run"
    assert train.main([*TINY, "--training.steps", "2", "--job.dump_folder", str(dump)]) == 0
    assert {"config.toml", "checkpoint/step-1/.complete", "checkpoint/step-2/.complete"} <= set(tree_digest(dump))
    assert any(name.startswith("tb/events.") for name in tree_digest(dump))
    return dump


@pytest.fixture
def dump(finished_run, tmp_path) -> Path:
    copy = tmp_path / "run"
    shutil.copytree(finished_run, copy)
    return copy


def refuse(dump: Path, caplog, *extra: str) -> str:
    """Run train.py's main with ``extra`` on ``dump``; asserts it is refused (exit 1) and changed nothing.
    Returns the error it logged."""
    before = tree_digest(dump)
    with caplog.at_level(logging.ERROR, logger="torchtitan_lite"):
        assert train.main([*TINY, "--training.steps", "4", "--job.dump_folder", str(dump), *extra]) == 1
    assert tree_digest(dump) == before
    return "\n".join(r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR)


def test_a_resume_with_other_model_args(dump, caplog):
    error = refuse(dump, caplog, "--model.n_layers", "3")
    assert "lacks" in error and "layers.2." in error and "step-2" in error


def test_an_unknown_state_to_exclude(dump, caplog):
    error = refuse(dump, caplog, "--checkpoint.exclude_from_loading", "nosuch")
    assert "checkpoint.exclude_from_loading has unknown state(s) ['nosuch']" in error


@pytest.mark.parametrize("checkpoints", ["saved", "none yet"])
def test_a_full_disk(dump, caplog, monkeypatch, checkpoints):
    if checkpoints == "none yet":  # the storage check must not leave the checkpoint folder it created
        shutil.rmtree(dump / "checkpoint")
    usage = shutil.disk_usage(dump)
    monkeypatch.setattr(shutil, "disk_usage", lambda _: usage._replace(free=1000))
    assert "less than one checkpoint of this run" in refuse(dump, caplog)


def test_a_read_only_checkpoint_folder(dump, caplog, monkeypatch):
    # A read-only bind mount of the checkpoint folder onto itself where this (root) process may mount;
    # elsewhere the write probe fails the way a read-only filesystem makes it fail.
    folder = dump / "checkpoint"
    mounted = os.geteuid() == 0 and subprocess.run(
        ["mount", "--bind", "-o", "ro", str(folder), str(folder)], capture_output=True, timeout=30).returncode == 0
    if not mounted:
        import errno

        from torchtitan_lite.components.checkpoint import disk

        def read_only_open(*args, **kwargs):
            raise OSError(errno.EROFS, "Read-only file system")

        monkeypatch.setattr(disk, "open", read_only_open, raising=False)
    try:
        error = refuse(dump, caplog)
    finally:
        if mounted:
            subprocess.run(["umount", str(folder)], check=False, timeout=30)
    assert "cannot write the checkpoint folder" in error and "the filesystem is read-only (EROFS)" in error


def test_a_corrupt_checkpoint_asked_for_by_step(dump, caplog):
    shard = next((dump / "checkpoint" / "step-2").glob("*.distcp"))
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x40
    shard.write_bytes(bytes(data))
    error = refuse(dump, caplog, "--checkpoint.load_step", "2")
    assert "checkpoint.load_step=2" in error and "fails verification" in error


def test_a_folder_another_run_holds(dump, caplog):
    from torchtitan_lite.run_lock import LOCK_NAME, _process_start

    holder = {"host": socket.gethostname(), "pid": os.getpid(), "pid_start": _process_start(os.getpid()),
              "start_time": "", "command": "train.py"}  # this live process
    (dump / LOCK_NAME).write_text(json.dumps(holder))
    assert "is in use by another run" in refuse(dump, caplog)


# --------------------------------------------------------------------------------------------------
# A token store (data.token_store) that cannot be trained on


@pytest.fixture(scope="module")
def written_store(tmp_path_factory) -> Path:
    from torchtitan_lite.components.data import TextDataLoader
    from torchtitan_lite.components.data.tokenize_store import write_store
    from torchtitan_lite.components.tokenizer import Tokenizer

    folder = tmp_path_factory.mktemp("tokens")
    docs = folder / "docs.jsonl"
    docs.write_text("".join(json.dumps({"text": f"def f{i}(x):\n    return x * {i}\n"}) + "\n" for i in range(40)))
    write_store(folder / "store" / "train", TextDataLoader.Config(dataset=str(docs)), "train",
                Tokenizer.Config().build())
    return folder / "store"


def _damage(store: Path, case: str) -> None:
    """What goes wrong with a store between pretokenize.py and the run."""
    from torchtitan_lite.components.checkpoint.checksums import hash_file

    train = store / "train"
    index = json.loads((train / "index.json").read_text())
    if case == "changed shard":
        data = bytearray((train / "shard-00000.tokens").read_bytes())
        data[10] ^= 1
        (train / "shard-00000.tokens").write_bytes(bytes(data))
    elif case == "id beyond the vocabulary":  # a consistent store (checksums match) of a larger vocabulary
        tokens = (train / "shard-00000.tokens")
        data = bytearray(tokens.read_bytes())
        data[10:12] = (60_000).to_bytes(2, "little")
        tokens.write_bytes(bytes(data))
        index["shards"][0]["checksums"]["tokens"] = hash_file(str(tokens))["hash"]
    elif case == "other tokenizer":
        index["tokenizer"].update(fingerprint="0" * 32, name="other/tokenizer.model")
    else:
        os.remove(train / "shard-00000.starts")
    (train / "index.json").write_text(json.dumps(index))


@pytest.mark.parametrize("case, message", [
    ("changed shard", r"shard-00000.tokens does not match its xxh3_128 checksum.*re-run scripts/pretokenize.py"),
    ("id beyond the vocabulary", r"shard-00000.tokens holds token id 60000, beyond the model's vocabulary of \d+ ids"),
    ("other tokenizer", r"written with tokenizer other/tokenizer.model \(fingerprint 0{32}\), this run tokenises with "
                        r".*\.model \(fingerprint [0-9a-f]{32}\)"),
    ("missing file", r"shard-00000.starts is missing; re-run scripts/pretokenize.py"),
])
def test_a_token_store_that_cannot_be_trained_on(dump, caplog, written_store, tmp_path, case, message):
    import re

    store = tmp_path / "store"
    shutil.copytree(written_store, store)
    _damage(store, case)
    error = refuse(dump, caplog, "--data.token_store", str(store))
    assert re.search(message, error), error


# --------------------------------------------------------------------------------------------------
# A mixture (data.sources) that cannot be trained on


def _mixture(tmp_path: Path, *, prose_weight: float, prose_dataset: str | None = None) -> str:
    """A TOML file of two sources, code (3) and prose; prose_dataset None writes prose's file."""
    (tmp_path / "code.jsonl").write_text("".join(json.dumps({"text": f"def f{i}(x):\n    return x + {i}\n"}) + "\n"
                                                 for i in range(40)))
    if prose_dataset is None:
        prose_dataset = str(tmp_path / "prose.jsonl")
        Path(prose_dataset).write_text("".join(json.dumps({"text": f"Day {i} was calm."}) + "\n" for i in range(40)))
    path = tmp_path / "mixture.toml"
    path.write_text(f'[[data.sources]]\nname = "code"\nweight = 3\ndataset = "{tmp_path / "code.jsonl"}"\n\n'
                    f'[[data.sources]]\nname = "prose"\nweight = {prose_weight}\ndataset = "{prose_dataset}"\n')
    return str(path)


@pytest.mark.parametrize("weight", [0, -1])
def test_a_mixture_weight_that_is_not_positive(dump, capsys, tmp_path, weight):
    before = tree_digest(dump)
    mixture = _mixture(tmp_path, prose_weight=weight)
    assert train.main([*TINY, "--training.steps", "4", "--job.dump_folder", str(dump), "--config-file", mixture]) == 2
    assert tree_digest(dump) == before
    error = capsys.readouterr().err
    assert f"source 'prose' has weight={weight}" in error and "must be a positive number: set it above 0" in error


def test_a_mixture_source_that_does_not_exist(dump, caplog, tmp_path):
    missing = tmp_path / "nowhere" / "prose.jsonl"
    error = refuse(dump, caplog, "--config-file", _mixture(tmp_path, prose_weight=1, prose_dataset=str(missing)))
    assert f"source 'prose' (data.sources.1): data.sources.1.dataset='{missing}' matches no files" in error
    assert "check the path or glob" in error
