"""The scripts in scripts/ are thin entry points over torchtitan_lite/tools: each still starts as a plain
``python scripts/NAME.py`` (its imports resolve, the model families and registry are wired) and shows its help."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
TOOL_SCRIPTS = ("benchmark", "_bench_worker", "bare_loop", "fp8_sqnr", "float8_layer_bench", "loss_compare",
                "trace_compare", "train_tokenizer", "torchtitan_side_by_side")


def _run(script: str, *args: str) -> subprocess.CompletedProcess[str]:
    # Started from outside the repository, as from any working folder.
    return subprocess.run([sys.executable, str(REPO / "scripts" / f"{script}.py"), *args], cwd="/",
                          capture_output=True, text=True, timeout=120, env=dict(os.environ, OMP_NUM_THREADS="1"))


@pytest.mark.parametrize("script", TOOL_SCRIPTS)
def test_script_shows_its_help(script):
    result = _run(script, "--help")
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.startswith(f"usage: {script}.py "), result.stdout[:200]


def test_torchtitan_cpu_script_prints_its_usage_without_a_command():
    # It runs in torchtitan's environment and has no argparse: an unknown command prints the module docstring.
    result = _run("_torchtitan_cpu")
    assert result.returncode == 2
    assert "python _torchtitan_cpu.py tokenizer OUT_DIR VOCAB_SIZE FILE.jsonl..." in result.stderr


@pytest.mark.parametrize("script", [*TOOL_SCRIPTS, "_torchtitan_cpu"])
def test_script_holds_no_logic(script):
    source = (REPO / "scripts" / f"{script}.py").read_text()
    assert "def " not in source and "class " not in source
    assert len(source.splitlines()) <= 15
