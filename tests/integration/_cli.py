"""Helpers to run the real entry points (run_train.sh / train.py) in a subprocess."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path


ROOT = Path(__file__).resolve().parents[2]


def _env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    # The suite already runs inside the project's interpreter; run_train.sh must not rebuild it.
    env["TTL_PYTHON"] = sys.executable
    env.setdefault("OMP_NUM_THREADS", "2")
    env.update(extra)
    return env


def run_cli(args: list[str], *, timeout: int = 600, launcher: str = "run_train.sh", **env: str):
    """Run ./run_train.sh (torchrun) or train.py (in-process) with ``args``; returns CompletedProcess."""
    cmd = [str(ROOT / "run_train.sh"), *args] if launcher == "run_train.sh" else [sys.executable, str(ROOT / "train.py"), *args]
    return subprocess.run(cmd, cwd=ROOT, env=_env(**env), capture_output=True, text=True, timeout=timeout)


def read_scalars(tb_dir: Path) -> dict[str, dict[int, float]]:
    """tag -> {step: value} from the TensorBoard event files of a run."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tb_dir), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: {e.step: e.value for e in acc.Scalars(tag)} for tag in acc.Tags()["scalars"]}
