"""Crashes: a process killed mid-save, and a rank killed under ``torchrun --max-restarts``.

Neither gets a chance to clean up (SIGKILL); what makes the run recoverable is that a checkpoint only
counts once its ``.complete`` marker is written, and that a run resumes from the newest complete one.
"""
from __future__ import annotations

import os
import re
import signal
import time

from _cli import TINY, Launch, read_scalars, train_cmd


def _complete(folder, step: int) -> bool:
    return (folder / "checkpoint" / f"step-{step}" / ".complete").is_file()


def _caught_mid_save(launch: Launch, folder, *, min_step: int, timeout: float = 120) -> int:
    """Freeze the run while a checkpoint folder has shard data but no marker, then SIGKILL it.

    SIGSTOP first makes the check race-free: the frozen process cannot write the marker between
    the check and the kill. Returns the step whose save was interrupted.
    """
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for path in (folder / "checkpoint").glob("step-*"):
            step = int(path.name[5:])
            if step >= min_step and not _complete(folder, step) and any(path.glob("*.distcp")):
                launch.signal_group(signal.SIGSTOP)
                if not _complete(folder, step):
                    launch.kill()
                    return step
                launch.signal_group(signal.SIGCONT)
        time.sleep(0.002)
    launch.kill()
    raise AssertionError(f"never saw a save in progress:\n{launch.output[-4000:]}")


def test_sigkill_mid_save_leaves_the_previous_checkpoint_loadable(tmp_path):
    # A save every step: most of each step's time is the save, so one is quickly caught in progress.
    args = ["--config", "llama3_debug", *TINY, "--checkpoint.enable", "true", "--checkpoint.interval", "1",
            "--job.dump_folder", str(tmp_path)]
    killed = Launch(train_cmd([*args, "--training.steps", "10000"]))
    step = _caught_mid_save(killed, tmp_path, min_step=3)
    assert killed.proc.returncode == -signal.SIGKILL
    assert not _complete(tmp_path, step) and _complete(tmp_path, step - 1)

    final = step + 2
    resumed = Launch(train_cmd([*args, "--training.steps", str(final)]))
    assert resumed.finish() == 0, resumed.output[-4000:]
    out = resumed.output
    assert "ignoring checkpoint folder(s) without a .complete marker" in out and f"step-{step}'" in out
    assert f"resumed from {tmp_path / 'checkpoint' / f'step-{step - 1}'}" in out
    assert f"training {final} steps from step {step - 1}" in out
    # The interrupted folder is replaced by a complete save of the same step.
    assert f"overwriting existing checkpoint folder {tmp_path / 'checkpoint' / f'step-{step}'}" in out
    assert all(_complete(tmp_path, s) for s in range(1, final + 1))
    assert max(read_scalars(tmp_path / "tb")["train/loss"]) == final


def test_torchrun_restarts_a_killed_rank_and_the_job_resumes_and_finishes(tmp_path):
    steps, interval = 24, 4
    launch = Launch(train_cmd(["--config", "llama3_debug", *TINY, "--parallelism.dp_shard", "2",
                               "--training.steps", str(steps), "--checkpoint.enable", "true",
                               "--checkpoint.interval", str(interval), "--job.dump_folder", str(tmp_path)],
                              nproc=2, torchrun_args=("--max-restarts", "1")))
    launch.wait_for(rf"\[rank0\].*step\s+{interval + 2}\s+loss")
    first_attempt = launch.worker_pids()
    os.kill(first_attempt[1], signal.SIGKILL)
    assert launch.finish() == 0, launch.output[-4000:]
    out = launch.output

    # torchrun saw rank 1 die of the SIGKILL (and restarted the group: the job still finished, with 0).
    death = re.search(r"failed \(exitcode: -9\) local_rank: 1 ", out)
    assert death, out[-4000:]
    after = out[death.end():]
    resumed = re.findall(r"\[rank(\d)\].*resumed from .*/checkpoint/step-(\d+) ", after)
    assert {int(r) for r, _ in resumed} == {0, 1}, out[-4000:]
    resumed_step = int(resumed[0][1])
    assert all(int(s) == resumed_step for _, s in resumed)
    assert resumed_step >= interval and resumed_step % interval == 0
    assert f"training {steps} steps from step {resumed_step}" in after
    # The restarted workers trained every remaining step once more and saved the final step.
    trained = [int(s) for s in re.findall(r"\[rank0\].*step\s+(\d+)\s+loss", after)]
    assert trained == list(range(resumed_step + 1, steps + 1))
    assert _complete(tmp_path, steps)
    assert max(read_scalars(tmp_path / "tb")["train/loss"]) == steps
