"""A second run on a live run's dump folder exits non-zero naming the first; the first is unharmed."""
from __future__ import annotations

from _cli import TINY, Launch, run_cli, train_cmd


def test_second_run_on_a_live_folder_is_refused(tmp_path):
    args = ["--config", "llama3_debug", *TINY, "--job.dump_folder", str(tmp_path), "--checkpoint.enable", "true",
            "--checkpoint.interval", "1000"]
    first = Launch(train_cmd([*args, "--training.steps", "100000"]))
    first.wait_for(r"step\s+1\b")
    pid = first.proc.pid
    second = run_cli([*args, "--training.steps", "2"], launcher="train.py")
    assert second.returncode == 1, second.stdout[-2000:] + second.stderr[-2000:]
    assert f"is in use by another run: pid {pid} on host" in second.stdout
    assert (tmp_path / ".run.lock").is_file()
    first.kill()
