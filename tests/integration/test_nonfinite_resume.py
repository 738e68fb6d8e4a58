"""Whether a normal loss followed a checkpoint outlives the process that saw it: a resume from a checkpoint
no normal loss followed warns when it loads, and a non-finite loss right after a resume blames the
checkpoint (in process, tiny runs; the non-finite loss is planted at a known step)."""
from __future__ import annotations

import logging

import pytest
from _spike_runs import build_trainer

from torchtitan_lite.components.checkpoint.layout import Marker
from torchtitan_lite.trainer import NonFiniteLossError, Trainer

CKPT = ["--checkpoint.enable", "true", "--checkpoint.interval", "1"]


def nan_loss_at(trainer: Trainer, step: int) -> Trainer:
    original = trainer.runner.loss_fn

    def loss_fn(logits, labels):
        loss_sum, count = original(logits, labels)
        return (loss_sum * float("nan") if trainer.train_state.step == step else loss_sum), count

    trainer.runner.loss_fn = loss_fn
    return trainer


def test_the_checkpoints_followed_by_normal_or_abnormal_losses_are_told_apart_across_runs(tmp_path, caplog):
    folder = tmp_path / "checkpoint"
    with pytest.raises(NonFiniteLossError) as first:
        nan_loss_at(build_trainer(tmp_path, 3, *CKPT), 3).train()
    # Clipping is on (llama3_debug's max_norm 1.0) and no float16: only the learning rate is named.
    assert str(first.value) == ("non-finite loss at step 3 (loss=nan, grad_norm=nan); stopping without saving, the "
                                "last good checkpoint is step 1. Lower optimizer.lr or lengthen "
                                "lr_scheduler.warmup_steps.")
    assert [Marker.read(str(folder / f"step-{s}")).followed_by for s in (1, 2)] == ["normal", "abnormal"]

    # A new process resuming from step 2 learns it from the marker, says so, and blames the checkpoint.
    with caplog.at_level(logging.WARNING), pytest.raises(NonFiniteLossError) as second:
        nan_loss_at(build_trainer(tmp_path, 4, *CKPT), 3).train()
    assert (f"resuming from {folder}/step-2, which no normal loss ever followed: the step trained from it went "
            f"non-finite or spiked before (recorded in its .complete marker), so its weights may be damaged. Step 1 "
            f"is the newest checkpoint a normal loss followed (--checkpoint.load_step 1)") in caplog.text
    assert str(second.value) == (
        "non-finite loss at step 3 (loss=nan, grad_norm=nan); stopping without saving, the last good checkpoint is "
        f"step 1. This is the first step trained from {folder}/step-2, so the checkpoint is the likely cause: no "
        "normal loss ever followed it (the step trained from it went non-finite or spiked before). Resume from step 1, "
        "the newest checkpoint a normal loss followed (--checkpoint.load_step 1).")

    # Going back to step 1 without checksums, with a normal step 2 this time: step 2's marker is rewritten by
    # the new save, and a run stopping later names the checkpoints this run vouched for.
    resumed = build_trainer(tmp_path, 3, *CKPT, "--checkpoint.load_step", "1", "--checkpoint.verify_checksums", "false")
    resumed.train()
    assert resumed.checkpointer.loaded is not None and resumed.checkpointer.loaded.unchecked == (
        "checkpoint.verify_checksums=false")
    assert [Marker.read(str(folder / f"step-{s}")).followed_by for s in (1, 2, 3)] == ["normal", "normal", "nothing"]
