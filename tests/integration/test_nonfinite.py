"""A diverging run stops with exit code 1, names the step and keeps the last good checkpoint."""
from __future__ import annotations

import re

import pytest
import torch
from _cli import TINY, read_checkpoint, run_cli

INTERVAL = 1
"""A save every step: a save of the diverged step itself, or a purge of the good one, would show."""


# With async saves the previous step's checkpoint is usually still being written when the next step
# diverges: it holds good state, so it must be finished and named, not left behind or skipped.
@pytest.mark.parametrize("async_mode", ["disabled", "async"])
def test_divergence_stops_naming_the_step_and_keeps_the_last_good_checkpoint(tmp_path, async_mode):
    # An absurd peak lr without clipping: the loss explodes within a few steps and the gradient
    # norm becomes NaN (the step varies with the CPU's kernels, so it is read from the message).
    result = run_cli(["--config", "llama3_debug", *TINY, "--training.steps", "50", "--optimizer.lr", "100",
                      "--training.max_norm", "0", "--checkpoint.enable", "true",
                      "--checkpoint.interval", str(INTERVAL), "--checkpoint.keep_latest_k", "1",
                      "--checkpoint.async_mode", async_mode, "--job.dump_folder", str(tmp_path)],
                     launcher="train.py", OMP_NUM_THREADS="1")
    assert result.returncode == 1, result.stdout[-3000:] + result.stderr[-3000:]

    found = re.search(r"non-finite (loss|gradient norm) at step (\d+) .*stopping without saving, "
                      r"the last good checkpoint is step (\d+)\. Lower optimizer\.lr", result.stdout)
    assert found, result.stdout[-3000:]
    bad, last_good = int(found[2]), int(found[3])
    assert bad > INTERVAL, f"diverged at step {bad}, before the first checkpoint: lower optimizer.lr"
    assert last_good == (bad - 1) // INTERVAL * INTERVAL

    # Only the last good checkpoint is there (keep_latest_k=1), complete; nothing at or after the bad step.
    folders = sorted(p.name for p in (tmp_path / "checkpoint").iterdir())
    assert folders == [f"step-{last_good}"]
    assert (tmp_path / "checkpoint" / f"step-{last_good}" / ".complete").is_file()
    # It holds the state after step `last_good`, all of it finite: a resume starts from sane weights.
    state = read_checkpoint(tmp_path / "checkpoint" / f"step-{last_good}")
    assert int(state["train_state.rank0.step"]) == last_good
    tensors = {k: v for k, v in state.items() if isinstance(v, torch.Tensor) and v.is_floating_point()}
    assert any(k.startswith("model.") for k in tensors) and any(k.startswith("optimizer.") for k in tensors)
    assert [k for k, v in tensors.items() if not bool(torch.isfinite(v).all())] == []
    assert state["lr_scheduler.last_step"] == last_good
