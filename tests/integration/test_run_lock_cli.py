"""A second run on a live run's dump folder exits non-zero naming the first; the first is unharmed."""
from __future__ import annotations

import re

from _cli import TINY, Launch, run_cli, train_cmd


def test_second_run_on_a_live_folder_is_refused(tmp_path):
    args = ["--config", "llama3_debug", *TINY, "--job.dump_folder", str(tmp_path), "--checkpoint.enable", "true",
            "--checkpoint.interval", "1000"]
    first = Launch(train_cmd([*args, "--training.steps", "100000"]))
    first.wait_for(r"step\s+1\b")
    pid = first.proc.pid
    # What describes the first run and marks its folder as taken, as the second run finds them.
    config, lock = (tmp_path / "config.toml").read_bytes(), (tmp_path / ".run.lock").read_bytes()
    second = run_cli([*args, "--training.steps", "2"], launcher="train.py")
    assert second.returncode == 1, second.stdout[-2000:] + second.stderr[-2000:]
    assert f"is in use by another run: pid {pid} on host" in second.stdout

    # The first run is unharmed: its lock and config are byte for byte what they were, and it trains on
    # past the step it had reached when the second run was refused.
    assert (tmp_path / ".run.lock").read_bytes() == lock
    assert (tmp_path / "config.toml").read_bytes() == config
    reached = max(int(s) for s in re.findall(r"step\s+(\d+)\b", first.output))
    first.wait_for(rf"step\s+{reached + 2}\b")
    assert first.proc.poll() is None and "Traceback" not in first.output
    first.kill()
