"""What the host reads of finished steps: the losses and gradient norms queued in ``PendingSteps``, applied in
step order to the loss statistics and the checkpoints they vouch for, the stop (with what it kept and why) at
a step whose loss or norm is not finite, and what a log step reads besides (the models' own statistics, the
FP16 scaler's counters, a mixture's tokens per source)."""
from __future__ import annotations

import math

import torch
import torch.distributed as dist

from torchtitan_lite.components.checkpoint import CheckpointManager
from torchtitan_lite.components.grad_scaler import GradScaler
from torchtitan_lite.distributed.pipeline.stats import gather_over_stages, read_part_stats
from torchtitan_lite.distributed.step_runner import StepRunner
from torchtitan_lite.loss_health import LossHealth
from torchtitan_lite.nonfinite import NonFiniteLossError, explain_nonfinite
from torchtitan_lite.protocols.model import BaseModel
from torchtitan_lite.step_values import PendingSteps, StepValues
from torchtitan_lite.train_state import TrainState


def settle(pending: PendingSteps, *, health: LossHealth, train_state: TrainState, checkpointer: CheckpointManager,
           stop_nonfinite: bool, scaled: bool, clipping: bool, fp16: bool) -> StepValues | None:
    """Read the steps queued since the last read (one device synchronisation) and act on them in step
    order, as if each had been read when it ended: stop at a non-finite one when ``stop_nonfinite`` (with the
    spike policy on, a non-finite value is a spike the policy handled), and let each normal loss vouch for the
    checkpoint before it. Returns the newest step's values, None when none was queued. ``scaled``,
    ``clipping`` and ``fp16`` are as in ``check_finite``.

    Without the spike policy a non-finite step is therefore found at the next log step, checkpoint
    save, validation or the last step, whichever comes first, and named by its own step number; the
    steps in between train on and nothing of theirs is logged, validated or saved."""
    read = pending.read()
    vouched = False
    for values in read:
        if stop_nonfinite and not (math.isfinite(values.loss) and math.isfinite(values.grad_norm)):
            check_finite(values.loss, values.grad_norm, step=values.step, checkpointer=checkpointer, health=health,
                         scaled=scaled, clipping=clipping, fp16=fp16)
        # A skipped step vouches for no checkpoint and does not join the loss statistics.
        if values.applied and health.observe(values.step, values.loss):
            vouched = True
        if values.applied:
            train_state.add_loss(values.loss)
    if vouched:
        checkpointer.known_good = frozenset(health.good_checkpoints)
    return read[-1] if read else None


def check_finite(loss: float, grad_norm: float, *, step: int, checkpointer: CheckpointManager, health: LossHealth,
                 scaled: bool, clipping: bool, fp16: bool) -> None:
    """Raise ``NonFiniteLossError`` unless the step's loss and gradient norm are finite. ``scaled``: an FP16
    loss scaler runs; ``clipping``: gradients are clipped; ``fp16``: the parameters are float16."""
    # With FP16 loss scaling an infinite grad norm is an overflow the scaler skips, not a failure.
    grad_ok = scaled or torch.isfinite(torch.tensor(grad_norm))
    if torch.isfinite(torch.tensor(loss)) and grad_ok:
        return
    # A background save still writing holds the last good state: finish it before naming it.
    checkpointer.wait()
    # The checkpoint this step trained from records it, so that a resume from it later says so.
    checkpointer.note_abnormal_loss(step)
    complete = checkpointer.complete_steps()
    # Good as this run saw it, or as the checkpoints' markers recorded it in earlier runs.
    good = sorted({s for s in complete if s in health.good_checkpoints}
                  | set(checkpointer.followed_by_normal_loss(complete)))
    loaded = checkpointer.loaded
    raise NonFiniteLossError(explain_nonfinite(
        step=step, loss=loss, grad_norm=grad_norm, complete=complete, good=good,
        resumed_from=loaded if loaded is not None and step == loaded.step + 1 else None,
        clipping=clipping, fp16=fp16))


def extra_metrics(grad_scaler: GradScaler | None) -> dict[str, float]:
    extra = {}
    if grad_scaler is not None:
        extra["loss_scale"] = float(grad_scaler.scale_value)
        extra["skipped_steps"] = float(grad_scaler.skipped_steps)
    return extra


def data_scalars(dataloader: object) -> dict[str, float]:
    """A mixture's input tokens per source so far, all ranks together (from the data position alone)."""
    per_source = getattr(dataloader, "tokens_per_source", None)
    return {} if per_source is None else {f"data/tokens/{name}": float(n) for name, n in per_source().items()}


def model_stats(model_parts: list[BaseModel], runner: StepRunner, *,
                dp_group: dist.ProcessGroup | None) -> tuple[dict[str, float], str | None]:
    """The models' own statistics since the previous log step (MoE router balance), read in one transfer,
    and their console summary, for the whole model (under a pipeline, every stage's). Collective: every rank
    calls it at every log step."""
    parts = read_part_stats([part.training_stats(dp_group) for part in model_parts])
    model = model_parts[0]
    values = model.merge_training_stats(gather_over_stages(parts, runner.loss_group))
    return (values, model.training_stats_summary(values)) if values else ({}, None)
