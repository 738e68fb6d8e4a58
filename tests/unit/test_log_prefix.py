"""One "[rankN]:" per line: under run_train.sh torchrun prefixes every worker line, so torch's own log
formatter (which adds the same prefix once a process group exists) must not add a second one."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

_WORKER = """
import logging, sys
sys.path.insert(0, {root!r})
import train
train._setup_logging()
import torch.distributed as dist
dist.init_process_group("gloo", init_method="file://{store}", rank=0, world_size=1)
logging.getLogger("torch.distributed").warning("probe warning")
dist.destroy_process_group()
"""


@pytest.mark.parametrize("launcher_prefixes, expected_prefix", [("1", ""), ("0", "[rank0]:")])
def test_torch_warnings_carry_the_rank_once(tmp_path, launcher_prefixes, expected_prefix):
    env = {k: v for k, v in os.environ.items() if k != "TORCH_LOGS_FORMAT"}
    env["TORCHTITAN_LITE_LAUNCHER_PREFIXES_RANK"] = launcher_prefixes
    code = _WORKER.format(root=str(ROOT), store=tmp_path / "store")
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    [line] = [line for line in (done.stdout + done.stderr).splitlines() if "probe warning" in line]
    # With the launcher's prefix the line starts with the time; run directly, torch's single prefix stays.
    assert line.startswith(expected_prefix) and line.count("[rank") == len(expected_prefix) // len("[rank0]:")
