"""The scripts in scripts/ are thin entry points over torchtitan_lite/tools: each still runs as a script (its
imports resolve, the model families and the registry are wired in) and shows its help."""
from __future__ import annotations

import re
import runpy
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
TOOL_SCRIPTS = ("benchmark", "_bench_worker", "bare_loop", "fp8_sqnr", "float8_layer_bench", "loss_compare",
                "trace_compare", "train_tokenizer", "torchtitan_side_by_side", "generate", "first_window_bench",
                "attention_bench", "compile_time_bench", "_compile_time_worker", "pipeline_bubble", "pretokenize",
                "data_loader_bench", "layout_equivalence", "planning_equivalence", "cp_attention_bench")


@pytest.mark.parametrize("script", TOOL_SCRIPTS)
def test_script_shows_its_help(script, monkeypatch, capsys):
    # In this process (torch is imported once for all of them); the script edits sys.path, restored afterwards.
    # scripts/benchmark.py, _bench_worker.py and bare_loop.py also run as processes in test_benchmark_script.py.
    path = REPO / "scripts" / f"{script}.py"
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.setattr(sys, "argv", [str(path), "--help"])
    with pytest.raises(SystemExit) as exit_info:
        runpy.run_path(str(path), run_name="__main__")
    assert exit_info.value.code == 0
    assert capsys.readouterr().out.startswith(f"usage: {script}.py ")


def test_torchtitan_cpu_script_prints_its_usage_without_a_command():
    # It runs in torchtitan's environment, started from any folder, and has no argparse: without a command
    # it prints the module docstring.
    result = subprocess.run([sys.executable, str(REPO / "scripts" / "_torchtitan_cpu.py")], cwd="/",
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert "python _torchtitan_cpu.py tokenizer OUT_DIR VOCAB_SIZE FILE.jsonl..." in result.stderr


@pytest.mark.parametrize("script", [*TOOL_SCRIPTS, "_torchtitan_cpu"])
def test_script_holds_no_logic(script):
    source = (REPO / "scripts" / f"{script}.py").read_text()
    assert "def " not in source and "class " not in source
    assert len(source.splitlines()) <= 18


@pytest.mark.parametrize("script", sorted(p.stem for p in (REPO / "scripts").glob("*.py")))
def test_scripts_that_reach_torchao_silence_its_notices_first(script):
    # torchao prints "Failed to load ..." for its CUDA kernels when first imported on a CPU-only machine;
    # script_start filters that (and torch's pytree notice) before anything imports torchao.
    source = (REPO / "scripts" / f"{script}.py").read_text()
    reaches_torchao = any(name in source for name in ("import models", "import config_registry",
                                                      "from config_registry"))
    if not reaches_torchao:
        return
    start = source.find("import torchtitan_lite.tools.script_start")
    assert start != -1, f"scripts/{script}.py must import torchtitan_lite.tools.script_start"
    # models imports no torchao (the import sorter puts it first); config_registry and the tools' mains may.
    later = [i for i in (source.find("config_registry"), source.find(" import main")) if i != -1]
    assert later and start < min(later)


# _torchrun_filter.py is standard library only (it filters torchrun's output); _torchtitan_cpu.py runs in
# torchtitan's own environment and must not switch to this project's.
STDLIB_OR_FOREIGN = {"_torchrun_filter", "_torchtitan_cpu"}


@pytest.mark.parametrize("script", sorted({p.stem for p in (REPO / "scripts").glob("*.py")} - STDLIB_OR_FOREIGN))
def test_scripts_start_again_under_the_project_python_before_importing_the_project(script):
    # A `python` without torch re-runs the script with scripts/setup_env.sh's interpreter; that must happen
    # before any import that needs torch (tests/integration/test_docs_commands.py runs the documented ones).
    lines = (REPO / "scripts" / f"{script}.py").read_text().splitlines()
    project = [i for i, line in enumerate(lines)
               if re.match(r"(import|from) (torchtitan_lite|models|config_registry)\b", line)]
    assert project and lines[project[0]].startswith("import torchtitan_lite.tools.project_python  # noqa")
