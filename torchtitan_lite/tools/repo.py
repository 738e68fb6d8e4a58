"""The checkout the tools drive.

train.py, run_train.sh and the ``scripts/`` entry points sit at the repository root, outside the
installed packages; the tools that launch them (benchmarks, loss comparison) find them here. The
environment installs this checkout in editable mode, so the root is two folders above this package.
"""
from __future__ import annotations

from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
SCRIPTS_DIR = REPO_ROOT / "scripts"
