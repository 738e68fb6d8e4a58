"""Imported first by train.py and every script: when the Python running them has no torch (a plain
`python` on PATH rather than the project's environment), the same command runs again with the
interpreter scripts/setup_env.sh names, as run_train.sh does: TTL_PYTHON when set, else ./.venv
(created on first use). Standard library only, and it must stay so: it runs before anything the project
depends on can be imported, in whatever Python the user typed."""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

SETUP_ENV = Path(__file__).resolve().parents[2] / "scripts" / "setup_env.sh"
# Set for the second run only: an interpreter that setup_env.sh names and that has no torch either
# must stop with the fix, not start itself again.
RERUN_FROM = "TORCHTITAN_LITE_RERUN_FROM"


def rerun_with_project_python() -> None:
    first_python = os.environ.pop(RERUN_FROM, None)
    if importlib.util.find_spec("torch") is not None:
        return
    if first_python is not None:
        sys.exit(f"error: {sys.executable}, the interpreter scripts/setup_env.sh names (TTL_PYTHON when set, "
                 f"else ./.venv), has no torch, nor has {first_python}, which started this command. Point "
                 "TTL_PYTHON at a Python with the project's dependencies, or unset it and run ./run_train.sh once "
                 "to create ./.venv.")
    python = _setup_env_python()
    # sys.orig_argv keeps the interpreter's own options (-u, -X ...) as the user typed them.
    argv = list(getattr(sys, "orig_argv", [sys.executable, *sys.argv]))
    os.environ[RERUN_FROM] = sys.executable
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(python, [python, *argv[1:]])


def _setup_env_python() -> str:
    fix = ("Run ./run_train.sh once (it creates ./.venv with the project's dependencies) or set TTL_PYTHON to "
           "a Python that has them.")
    try:
        # setup_env.sh's progress goes to stderr, where the user sees it; stdout is the interpreter's path.
        result = subprocess.run(["bash", str(SETUP_ENV)], stdout=subprocess.PIPE, text=True)
    except OSError as err:
        sys.exit(f"error: {sys.executable} has no torch, and {SETUP_ENV} could not run ({err}). {fix}")
    lines = result.stdout.strip().splitlines()
    if result.returncode != 0 or not lines:
        sys.exit(f"error: {sys.executable} has no torch, and {SETUP_ENV} named no interpreter that has "
                 f"(exit {result.returncode}). {fix}")
    return lines[-1]


rerun_with_project_python()
