"""scripts/verify_checkpoint.py on a path that holds no checkpoint: each mistake gets its own message naming
what the path is and what to pass instead."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from torchtitan_lite.components.checkpoint import CheckpointError
from torchtitan_lite.components.checkpoint.verify import verify_folder

ROOT = Path(__file__).resolve().parents[2]
USAGE = "give a checkpoint folder (step-<N>) or the folder holding them (<dump_folder>/checkpoint)"


def _message(path: Path) -> str:
    with pytest.raises(CheckpointError) as error:
        verify_folder(str(path))
    return str(error.value)


def test_each_path_without_a_checkpoint_gets_its_own_message(tmp_path):
    missing = tmp_path / "nowhere"
    a_file = tmp_path / "config.toml"
    a_file.write_text("")
    dump = tmp_path / "run"
    (dump / "checkpoint" / "step-10").mkdir(parents=True)
    (dump / "checkpoint" / "step-10" / ".complete").write_text("{}")
    empty_step = tmp_path / "ckpt" / "step-5"
    empty_step.mkdir(parents=True)
    partial_step = tmp_path / "ckpt" / "step-6"
    partial_step.mkdir()
    (partial_step / "__0_0.distcp").write_bytes(b"x")
    other = tmp_path / "other"
    other.mkdir()
    messages = {
        "missing": _message(missing), "file": _message(a_file), "dump": _message(dump),
        "empty step": _message(empty_step), "partial step": _message(partial_step), "other": _message(other)}
    assert messages == {
        "missing": f"{missing} does not exist; {USAGE}",
        "file": f"{a_file} is a file, not a checkpoint folder; {USAGE}",
        "dump": f"{dump} holds no step-<N> folders itself, but checkpoint in it does (a run's dump folder): verify "
                f"{dump / 'checkpoint'}",
        "empty step": f"{empty_step} is a step folder without a checkpoint: no .complete marker and no .metadata (it is "
                      f"empty), so nothing there was ever loadable; verify {tmp_path / 'ckpt'} to see the complete steps",
        "partial step": f"{partial_step} is a step folder without a checkpoint: no .complete marker and no .metadata "
                        f"(it holds 1 file(s) of a save that never finished), so nothing there was ever loadable; "
                        f"verify {tmp_path / 'ckpt'} to see the complete steps",
        "other": f"{other} holds neither a checkpoint nor step-<N> checkpoint folders; {USAGE}",
    }


def test_the_script_prints_the_message_as_one_error_line(tmp_path):
    result = subprocess.run([sys.executable, str(ROOT / "scripts" / "verify_checkpoint.py"), str(tmp_path / "nowhere")],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert result.stderr == f"error: {tmp_path / 'nowhere'} does not exist; {USAGE}\n"
