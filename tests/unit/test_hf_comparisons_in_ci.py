"""The tests that hold our models against transformers fail in CI when transformers does not import, instead of
skipping: a skipped comparison would let an MLA, YaRN or expert-order bug through a green run."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
COMPARISONS = ["unit/test_qwen3_moe_hf.py", "unit/test_deepseek_v3_hf.py"]


def test_without_transformers_the_hf_comparisons_fail_in_ci(tmp_path):
    # A transformers package that cannot be imported, first on the path: to the importer, an environment without it.
    (tmp_path / "transformers").mkdir()
    (tmp_path / "transformers" / "__init__.py").write_text("raise ModuleNotFoundError('no transformers here')\n")
    env = {**os.environ, "CI": "true", "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--collect-only",
                             *COMPARISONS], cwd=TESTS, env=env, capture_output=True, text=True, timeout=600)
    out = result.stdout + result.stderr
    assert result.returncode != 0, out
    for name in COMPARISONS:
        assert f"ERROR {name} - Failed: CI=true but transformers does not import (no transformers here)" in out, out


def test_every_test_that_needs_transformers_asks_through_the_ci_aware_import():
    # A bare importorskip would turn a broken install in CI back into silent skips.
    exempt = ("_transformers.py", Path(__file__).name)
    direct = sorted(str(path.relative_to(TESTS)) for path in TESTS.rglob("*.py")
                    if path.name not in exempt and 'importorskip("transformers")' in path.read_text())
    assert direct == [], f"use _transformers.import_transformers() instead of pytest.importorskip in {direct}"
