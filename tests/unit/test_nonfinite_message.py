"""The non-finite loss message names only the causes that fit the run (exact texts)."""
from __future__ import annotations

import math

from torchtitan_lite.components.checkpoint.manager import LoadedCheckpoint
from torchtitan_lite.nonfinite import explain_nonfinite

NAN = math.nan
HEAD = "non-finite loss at step 7 (loss=nan, grad_norm=nan); stopping without saving, "


def message(*, resumed_from=None, clipping=True, fp16=False, good=(4,), complete=(2, 4, 6)) -> str:
    return explain_nonfinite(step=7, loss=NAN, grad_norm=NAN, complete=list(complete), good=list(good),
                             resumed_from=resumed_from, clipping=clipping, fp16=fp16)


def test_a_run_that_clips_in_float32_is_told_only_about_the_learning_rate():
    assert message() == HEAD + "the last good checkpoint is step 4. Lower optimizer.lr or lengthen lr_scheduler.warmup_steps."


def test_clipping_is_suggested_only_when_it_is_off_and_bfloat16_only_in_float16():
    assert message(clipping=False, good=(), complete=()) == (
        HEAD + "no checkpoint was saved. Lower optimizer.lr or lengthen lr_scheduler.warmup_steps, or enable clipping "
               "(training.max_norm).")
    assert message(clipping=False, fp16=True, good=()) == (
        HEAD + "no checkpoint is known good (none of steps [2, 4, 6] was followed by a normal loss). Lower "
               "optimizer.lr or lengthen lr_scheduler.warmup_steps, enable clipping (training.max_norm), or use "
               "precision.param_dtype=bfloat16 instead of float16.")
    assert message(fp16=True).endswith(
        "Lower optimizer.lr or lengthen lr_scheduler.warmup_steps, or use precision.param_dtype=bfloat16 instead of "
        "float16.")


def test_the_first_step_after_loading_unchecked_weights_blames_the_checkpoint():
    ckpt = LoadedCheckpoint(path="d/checkpoint/step-6", step=6, unchecked="checkpoint.verify_checksums=false",
                            followed_by="normal")
    assert message(resumed_from=ckpt, good=(4, 6), clipping=False, fp16=True) == (
        HEAD + "the last good checkpoint is step 4. This is the first step trained from d/checkpoint/step-6, so the "
               "checkpoint is the likely cause: its files were not checked against their checksums "
               "(checkpoint.verify_checksums=false). Resume from step 4, the newest checkpoint a normal loss "
               "followed (--checkpoint.load_step 4), or check its files with scripts/verify_checkpoint.py "
               "d/checkpoint/step-6.")


def test_the_first_step_after_loading_a_checkpoint_no_normal_loss_followed_blames_it():
    for followed_by, why in [("abnormal", "the step trained from it went non-finite or spiked before"),
                             ("nothing", "no step had trained from it before this one")]:
        ckpt = LoadedCheckpoint(path="d/checkpoint/step-6", step=6, unchecked=None, followed_by=followed_by)
        assert message(resumed_from=ckpt, good=()) == (
            HEAD + "no checkpoint is known good (none of steps [2, 4, 6] was followed by a normal loss). This is the "
                   "first step trained from d/checkpoint/step-6, so the checkpoint is the likely cause: no normal "
                   f"loss ever followed it ({why}). Resume from an earlier checkpoint (--checkpoint.load_step N).")


def test_a_verified_checkpoint_a_normal_loss_followed_points_back_to_the_settings():
    ckpt = LoadedCheckpoint(path="d/checkpoint/step-6", step=6, unchecked=None, followed_by="normal")
    assert message(resumed_from=ckpt, good=(4, 6)) == (
        HEAD + "the last good checkpoint is step 4. This is the first step trained from d/checkpoint/step-6, which "
               "passed its checksums and a normal loss followed it before: a setting changed since it was saved is "
               "the more likely cause. Lower optimizer.lr or lengthen lr_scheduler.warmup_steps.")
