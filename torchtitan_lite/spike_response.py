"""The trainer's side of ``training.spike_policy``: every rank judges the same numbers, each spike is
reported, a rollback restores the newest good checkpoint and records itself, and the batches that caused
it are skipped when training reaches them again. ``spike_guard.py`` decides; this module acts."""
from __future__ import annotations

import logging
import math
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from torchtitan_lite.components.checkpoint import CheckpointManager
from torchtitan_lite.components.metrics import MetricsProcessor
from torchtitan_lite.loss_health import LossHealth
from torchtitan_lite.spike_guard import SpikeGuard, Verdict

logger = logging.getLogger("torchtitan_lite")

SPIKE_RECORD = "spike_rollbacks"
"""<checkpoint folder>/spike_rollbacks.json: every rollback of the run, written the moment it happens."""


class SpikeResponse:
    def __init__(self, guard: SpikeGuard, *, checkpointer: CheckpointManager, metrics: MetricsProcessor,
                 health: LossHealth, device: torch.device) -> None:
        self.guard = guard
        self.checkpointer = checkpointer
        self.metrics = metrics
        self.health = health
        self.device = device

    def resume(self, step: int) -> None:
        """After loading ``step``: rollbacks recorded since that checkpoint still skip their data."""
        self.guard.adopt_recorded(self.checkpointer.read_record(SPIKE_RECORD, []), step)
        self.checkpointer.known_good = frozenset(self.health.good_checkpoints)

    def judge(self, step: int, loss: torch.Tensor, grad_norm: torch.Tensor, *,
              overflow: bool) -> tuple[Verdict, tuple[float, float]]:
        """The verdict on step ``step`` and this rank's (loss, grad norm) as floats, from one device read."""
        # The loss and norm are already reduced over the ranks; one MAX all-reduce makes every rank judge
        # bit-identical numbers all the same (non-finite values count as +inf, which MAX keeps).
        local = torch.stack([loss.detach(), grad_norm.detach().to(loss.device)]).double()
        agreed = torch.where(torch.isfinite(local), local, torch.full_like(local, math.inf))
        if dist.is_initialized() and dist.get_world_size() > 1:
            agreed = agreed.to(self.device)
            dist.all_reduce(agreed, op=dist.ReduceOp.MAX)
        loss_value, norm_value, *agreed_values = torch.cat([local.to(agreed.device), agreed]).tolist()
        values = dict(zip(("loss", "grad_norm"), agreed_values, strict=True))
        return self.guard.judge(step, values, overflow=overflow), (loss_value, norm_value)

    def report(self, step: int, verdict: Verdict, *, logged: bool) -> None:
        """Console line for each spike, spike/ scalars on each spike and each logged step."""
        if verdict.action in ("skip", "rollback"):
            logger.warning("loss spike at step %s: %s", step, verdict.reason)
            self.checkpointer.note_abnormal_loss(step)
        if verdict.action != "rollback" and (logged or verdict.action == "skip"):  # a rollback logs its own
            self.metrics.log_scalars(self.guard.scalars(), step)

    def roll_back(self, *, total_steps: int) -> int:
        """Every state back to the newest good checkpoint before the spike (collective); returns its step."""
        guard = self.guard
        spike_z = guard.last_z  # restoring the checkpoint brings back the detector's z-score of that time
        self.checkpointer.wait()
        plan = guard.plan_rollback(self.checkpointer.rollback_candidates())
        aside = f"rolled_back_{guard.rollbacks + 1}"
        guard.roll_back(plan, lambda step: self.checkpointer.roll_back(step, set_aside_as=aside))
        self.checkpointer.known_good = frozenset(self.health.good_checkpoints)
        records = self.checkpointer.read_record(SPIKE_RECORD, [])
        records.append({"rollback": guard.rollbacks, "to_step": plan.to_step, "spike_steps": list(plan.spike_steps),
                        "skip_data_of_steps": [plan.first_data_step, plan.last_data_step]})
        self.checkpointer.write_record(SPIKE_RECORD, records)
        logger.warning("rollback %d of %d: back to the checkpoint of step %d after the spike at steps %s; the "
                       "batches of steps %d-%d (%d steps) are skipped when training reaches step %d again",
                       guard.rollbacks, guard.config.max_rollbacks, plan.to_step, list(plan.spike_steps),
                       plan.first_data_step, plan.last_data_step, plan.data_steps, plan.first_data_step)
        self.metrics.log_scalars(guard.scalars(z_score=spike_z), plan.spike_steps[-1])
        self.metrics.begin(plan.to_step, total_steps)
        return plan.to_step

    def skip_data(self, step: int, data_iter: Iterator[Any], *, batches_per_step: int) -> None:
        """Before ``step`` draws its batches: drop those of the steps a rollback decided to skip."""
        window = self.guard.data_to_skip(step)
        if window is None:
            return
        first, last = window
        for _ in range((last - first + 1) * batches_per_step):
            next(data_iter)
        logger.warning("skipped the batches of steps %d-%d of the rolled-back run (%d batches); step %d trains "
                       "on the data that followed them", first, last, (last - first + 1) * batches_per_step, step)
