"""What a run that stops on a non-finite loss says: where it stopped, what it kept, and only the causes that
fit it. The first step trained from a loaded checkpoint points at that checkpoint (unverified files, a state
no normal loss ever followed) before the settings; clipping is suggested only when it is off, leaving
float16 only when the run uses it."""
from __future__ import annotations

import math

from torchtitan_lite.components.checkpoint.layout import ABNORMAL, NORMAL, NOTHING_YET
from torchtitan_lite.components.checkpoint.manager import LoadedCheckpoint


class NonFiniteLossError(RuntimeError):
    """Raised when the loss or the gradient norm stops being finite."""


def explain_nonfinite(*, step: int, loss: float, grad_norm: float, complete: list[int], good: list[int],
                      resumed_from: LoadedCheckpoint | None, clipping: bool, fp16: bool) -> str:
    """The message of the run's ``NonFiniteLossError``.

    ``complete``: steps with a complete checkpoint; ``good``: those a normal loss followed (ascending);
    ``resumed_from``: the checkpoint this step trained from, when it is the first step after loading one.
    """
    what = "loss" if not math.isfinite(loss) else "gradient norm"
    if resumed_from is not None:  # the state it held just went non-finite: whatever followed it once, not "good" now
        good = [s for s in good if s != resumed_from.step]
    if good:
        kept = f"the last good checkpoint is step {good[-1]}"
    elif complete:
        # Checkpoint N is good once step N+1 trained to a normal loss; none of these has been seen to.
        kept = f"no checkpoint is known good (none of steps {complete} was followed by a normal loss)"
    else:
        kept = "no checkpoint was saved"
    head = f"non-finite {what} at step {step} (loss={loss}, grad_norm={grad_norm}); stopping without saving, {kept}."
    settings = _setting_fixes(clipping=clipping, fp16=fp16)
    if resumed_from is None:
        return f"{head} {settings}"
    return f"{head} {_blame_checkpoint(resumed_from, good, settings)}"


def _setting_fixes(*, clipping: bool, fp16: bool) -> str:
    fixes = ["Lower optimizer.lr or lengthen lr_scheduler.warmup_steps"]
    if not clipping:
        fixes.append("enable clipping (training.max_norm)")
    if fp16:
        fixes.append("use precision.param_dtype=bfloat16 instead of float16")
    listed = fixes[0] if len(fixes) == 1 else f"{', '.join(fixes[:-1])}, or {fixes[-1]}"
    return f"{listed}."


def _blame_checkpoint(ckpt: LoadedCheckpoint, good: list[int], settings: str) -> str:
    doubts = []
    if ckpt.followed_by == ABNORMAL:
        doubts.append("no normal loss ever followed it (the step trained from it went non-finite or spiked before)")
    elif ckpt.followed_by == NOTHING_YET:
        doubts.append("no normal loss ever followed it (no step had trained from it before this one)")
    if ckpt.unchecked is not None:
        doubts.append(f"its files were not checked against their checksums ({ckpt.unchecked})")
    first = f"This is the first step trained from {ckpt.path}"
    if not doubts:
        vouched = " and a normal loss followed it before" if ckpt.followed_by == NORMAL else ""
        return (f"{first}, which passed its checksums{vouched}: a setting changed since it was saved is the more "
                f"likely cause. {settings}")
    instead = (f"step {good[-1]}, the newest checkpoint a normal loss followed (--checkpoint.load_step {good[-1]})"
               if good else "an earlier checkpoint (--checkpoint.load_step N)")
    check = f", or check its files with scripts/verify_checkpoint.py {ckpt.path}" if ckpt.unchecked else ""
    return f"{first}, so the checkpoint is the likely cause: {'; '.join(doubts)}. Resume from {instead}{check}."
