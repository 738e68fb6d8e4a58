"""scripts/run_tests.sh (README command 2) runs the default suite: every case not marked slow, after the linter
and the type checker; a ``-m`` of the caller replaces that selection (``-m slow``: only the slow cases,
``-m ""``: everything). Checked with a stand-in interpreter that records its arguments instead of running them."""
from __future__ import annotations

import os
import shlex
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _calls(tmp_path: Path, *args: str) -> list[list[str]]:
    """The interpreter's argument lists, one per call, that ``scripts/run_tests.sh args`` makes."""
    log = tmp_path / "calls"
    python = tmp_path / "python"
    python.write_text(f'#!/usr/bin/env bash\nprintf "%q " "$@" >> {log}\necho >> {log}\n')
    python.chmod(0o755)
    env = {**os.environ, "TTL_PYTHON": str(python)}
    result = subprocess.run(["bash", str(ROOT / "scripts" / "run_tests.sh"), *args], env=env, capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    return [shlex.split(line) for line in log.read_text().splitlines()]


def test_the_default_run_lints_type_checks_then_leaves_out_the_slow_cases(tmp_path):
    ruff, mypy, pytest_call = _calls(tmp_path)
    assert ruff[:3] == ["-m", "ruff", "check"] and mypy[:2] == ["-m", "mypy"]
    assert pytest_call[:2] == ["-m", "pytest"]
    assert pytest_call[pytest_call.index("-m", 1):][:2] == ["-m", "not slow"]


@pytest.mark.parametrize("args", [["-m", "slow"], ["-m", ""], ["-mslow"], ["--markexpr=slow"], ["-k", "x", "-m", "gpu"]])
def test_a_selection_of_the_caller_replaces_the_default_one(tmp_path, args):
    pytest_call = _calls(tmp_path, *args)[-1]
    assert "not slow" not in pytest_call
    assert pytest_call[-len(args):] == args  # passed on as given


def test_other_arguments_keep_the_default_selection(tmp_path):
    pytest_call = _calls(tmp_path, "-k", "config", "tests/unit")[-1]
    assert "not slow" in pytest_call and pytest_call[-3:] == ["-k", "config", "tests/unit"]
