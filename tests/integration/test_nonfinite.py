"""A diverging run stops with exit code 1, names the step and keeps the last good checkpoint."""
from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from _cli import TINY, read_checkpoint, run_cli

INTERVAL = 1
"""A save every step: a save of the diverged step itself, or a purge of the good one, would show."""


DIVERGE_AT = 6
"""The first step whose loss is non-finite (planted: see _diverging_train.py)."""


# With async saves the previous step's checkpoint is usually still being written when the next step
# diverges: it holds good state, so it must be finished and named, not left behind or skipped.
@pytest.mark.parametrize("async_mode", ["disabled", "async"])
def test_divergence_stops_naming_the_step_and_keeps_the_last_good_checkpoint(tmp_path, async_mode):
    result = run_cli(["--config", "llama3_debug", *TINY, "--training.steps", "20",
                      "--checkpoint.enable", "true",
                      "--checkpoint.interval", str(INTERVAL), "--checkpoint.keep_latest_k", "1",
                      "--checkpoint.async_mode", async_mode, "--job.dump_folder", str(tmp_path)],
                     launcher=str(Path(__file__).parent / "_diverging_train.py"), OMP_NUM_THREADS="1",
                     TTL_TEST_DIVERGE_AT=str(DIVERGE_AT))
    assert result.returncode == 1, result.stdout[-3000:] + result.stderr[-3000:]

    found = re.search(r"non-finite (loss|gradient norm) at step (\d+) .*stopping without saving, "
                      r"the last good checkpoint is step (\d+)\. Lower optimizer\.lr", result.stdout)
    assert found, result.stdout[-3000:]
    bad, last_good = int(found[2]), int(found[3])
    # Checkpoint N is good once step N+1 trained to a normal loss: the one just before the bad step never is.
    assert (bad, last_good) == (DIVERGE_AT, DIVERGE_AT - 2)
    losses = {int(m[1]): float(m[2]) for m in re.finditer(r"step\s+(\d+)\s+loss\s+(\S+)", result.stdout)}
    assert losses[last_good + 1] < 3 * losses[1], losses  # within the spike bounds (3x the running mean at most)

    # keep_latest_k=1 keeps the newest checkpoint and, protected from purging, the last good one;
    # nothing at or after the bad step.
    folders = {p.name for p in (tmp_path / "checkpoint").iterdir()}
    assert folders == {f"step-{last_good}", f"step-{bad - 1}"}
    assert (tmp_path / "checkpoint" / f"step-{last_good}" / ".complete").is_file()
    # It holds the state after step `last_good`, all of it finite: a resume starts from sane weights.
    state = read_checkpoint(tmp_path / "checkpoint" / f"step-{last_good}")
    assert int(state["train_state.rank0.step"]) == last_good
    tensors = {k: v for k, v in state.items() if isinstance(v, torch.Tensor) and v.is_floating_point()}
    assert any(k.startswith("model.") for k in tensors) and any(k.startswith("optimizer.") for k in tensors)
    assert [k for k, v in tensors.items() if not bool(torch.isfinite(v).all())] == []
    assert state["lr_scheduler.last_step"] == last_good


def test_a_blown_up_checkpoint_is_never_named_good(tmp_path):
    # Step 2's loss is planted 1e6 times too large (what a blown-up update from step 1 shows; a real one, lr
    # 1e3, does so on an AVX2 host but leaves a dead network with a normal-looking loss, ln(vocab), on an
    # AMX one), step 3's non-finite: checkpoint 1 must not be named as the one to go back to.
    result = run_cli(["--config", "llama3_debug", *TINY, "--training.steps", "20", "--checkpoint.enable", "true",
                      "--checkpoint.interval", "1", "--job.dump_folder", str(tmp_path)],
                     launcher=str(Path(__file__).parent / "_diverging_train.py"), OMP_NUM_THREADS="1",
                     TTL_TEST_DIVERGE_AT="3", TTL_TEST_SPIKE_AT="2")
    assert result.returncode == 1, result.stdout[-3000:] + result.stderr[-3000:]
    found = re.search(r"non-finite .* at step (\d+) .*stopping without saving, (.*?)\. Lower", result.stdout)
    assert found, result.stdout[-3000:]
    assert "last good checkpoint is step 1" not in found[2]
    assert found[2].startswith("no checkpoint is known good"), found[2]
