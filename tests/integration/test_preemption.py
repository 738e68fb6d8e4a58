"""Preemption: SIGUSR1 / SIGTERM finish the current step, save a complete checkpoint and exit cleanly.

Three launches of an FSDP 2 run through scripts/torchrun_graceful.sh (as run_train.sh launches):
A. Only rank 1 gets SIGUSR1 (schedulers do not signal every process at the same instant). The ranks
   agree through their per-step all-reduce, both stop after the same step, both save, both exit 0,
   so the launch exits 0.
B. Resumes from A's checkpoint; SIGTERM goes to the whole process group (launcher, torchrun and
   workers, as a terminal or scheduler does). Workers stop, save and exit 0, and so does the launch:
   torchrun ignores the signal instead of re-raising it.
C. Resumes from B's; only the launcher gets SIGUSR1 (a batch shell's "time is nearly up" notice) and
   passes it on; without that, SIGUSR1 would kill torchrun and orphan the workers.
"""
from __future__ import annotations

import json
import os
import re
import signal

from _cli import TINY, Launch, read_scalars, train_cmd


def _args(folder) -> list[str]:
    # No periodic saves: the only checkpoints are the ones the signals force.
    return ["--config", "llama3_debug", *TINY, "--parallelism.dp_shard", "2", "--training.steps", "10000",
            "--checkpoint.enable", "true", "--checkpoint.interval", "10000", "--job.dump_folder", str(folder)]


def _stopped_steps(output: str) -> dict[int, int]:
    """rank -> the step after which it stopped, from the trainer's log."""
    found = re.findall(r"\[rank(\d)\].*stopped by signal after step (\d+); checkpoint saved", output)
    return {int(rank): int(step) for rank, step in found}


def _complete_steps(folder) -> list[int]:
    ckpt = folder / "checkpoint"
    return sorted(int(p.name[5:]) for p in ckpt.glob("step-*") if (p / ".complete").is_file())


def test_signals_stop_every_rank_at_one_step_with_a_complete_checkpoint_that_resumes(tmp_path):
    a = Launch(train_cmd(_args(tmp_path), nproc=2))
    a.wait_for(r"step\s+3\s+loss")
    a_pid = a.worker_pids()
    assert sorted(a_pid) == [0, 1]
    os.kill(a_pid[1], signal.SIGUSR1)
    assert a.finish() == 0, a.output[-4000:]

    stopped = _stopped_steps(a.output)
    assert set(stopped) == {0, 1} and stopped[0] == stopped[1], a.output[-4000:]
    k = stopped[0]
    assert k >= 3
    assert "[rank1]" in a.output and re.search(r"\[rank1\].*received SIGUSR1", a.output)
    assert not re.search(r"\[rank0\].*received SIG", a.output)  # rank 0 stopped only through the agreement
    assert _complete_steps(tmp_path) == [k]
    marker = json.loads((tmp_path / "checkpoint" / f"step-{k}" / ".complete").read_text())
    assert marker["world_size"] == 2 and "optimizer" in marker["states"] and "dataloader" in marker["states"]
    assert max(read_scalars(tmp_path / "tb")["train/loss"]) == k

    b = Launch(train_cmd(_args(tmp_path), nproc=2))
    b.wait_for(rf"step\s+{k + 2}\s+loss")
    b.signal_group(signal.SIGTERM)
    assert b.finish() == 0, b.output[-4000:]
    assert f"resumed from {tmp_path / 'checkpoint' / f'step-{k}'}" in b.output
    assert f"training 10000 steps from step {k}" in b.output
    assert re.search(rf"\[rank0\].*step\s+{k + 1}\s+loss", b.output)
    assert not re.search(rf"\[rank0\].*step\s+{k}\s+loss", b.output)  # no step is trained twice
    stopped = _stopped_steps(b.output)
    assert set(stopped) == {0, 1} and stopped[0] == stopped[1] >= k + 2, b.output[-4000:]
    assert "ChildFailedError" not in b.output and "death signal" not in b.output
    assert _complete_steps(tmp_path) == [k, stopped[0]]

    m = stopped[0]
    c = Launch(train_cmd(_args(tmp_path), nproc=2))
    c.wait_for(rf"step\s+{m + 2}\s+loss")
    c.signal_launcher(signal.SIGUSR1)
    assert c.finish() == 0, c.output[-4000:]
    assert f"resumed from {tmp_path / 'checkpoint' / f'step-{m}'}" in c.output
    assert re.search(r"\[rank0\].*received SIGUSR1", c.output)
    stopped = _stopped_steps(c.output)
    assert set(stopped) == {0, 1} and stopped[0] == stopped[1] >= m + 2, c.output[-4000:]
    assert _complete_steps(tmp_path) == [k, m, stopped[0]]


def test_a_signal_without_checkpointing_says_nothing_was_saved(tmp_path):
    run = Launch(train_cmd(["--config", "llama3_debug", *TINY, "--training.steps", "10000",
                            "--checkpoint.enable", "false", "--job.dump_folder", str(tmp_path)]))
    run.wait_for(r"step\s+2\s+loss")
    run.signal_launcher(signal.SIGTERM)
    assert run.finish() == 0, run.output[-4000:]
    assert re.search(r"stopped by signal after step \d+; no checkpoint written: --checkpoint.enable true",
                     run.output)
    assert not (tmp_path / "checkpoint").exists()
