"""Loss spikes (``training.spike_policy``): skip the update of a step whose loss or gradient norm jumps
far above its recent values; past a limit, go back to the last good checkpoint and skip the data around
the spike (the PaLM recipe: restart ~100 steps before the spike and skip ~200-500 batches).

Detection. For each watched signal (the step's loss over all data-parallel ranks, and/or its gradient
norm before clipping) the guard keeps the values of the last ``window`` applied steps. Once
``min_history`` of them are in, a value above ``mean + k_sigma * std`` is a spike; a non-finite loss or
gradient norm (watched or not) is a spike at once. Skipped steps never enter the statistics, so a spike
cannot raise the bar for the next one. Every rank judges the same numbers (the trainer agrees on them
with one all-reduce), so every rank skips the same steps.

A skipped step trains nothing: no optimizer update (Adam's moments and step count stay) and its
gradients are zeroed. Otherwise it is a normal step: its batches are consumed, the step counter and the
learning-rate schedule advance (the schedule stays a function of the step number, as it does for a step
the FP16 loss scaler skips), and it is logged. A step the FP16 scaler skips for a gradient overflow
belongs to the scaler: it is neither a spike nor a normal value here, so nothing is counted twice (a
non-finite loss, though, is a spike: the scaler would only lower its scale, step after step).

Rollback. More than ``max_consecutive_skips`` spiking steps in a row, or more than ``max_total_skips``
skipped steps since the last rollback, roll the run back: every state (model, optimizer, schedule, data
position, RNGs, this guard's statistics) is reloaded from the newest complete checkpoint that is older
than the first spiking step and known good (the step after it trained to a normal loss), and the batches
of the steps from ``rollback_skip_before`` steps before the first spike (never earlier than the
checkpoint) to ``rollback_skip_after`` steps after the last one are skipped when training reaches them
again. Until then the window is part of this guard's checkpointed state, and it is also written to the
checkpoint folder at once (``spike_rollbacks.json``), so a run that stops before its next save still
skips it when it resumes; afterwards the data loader's own position is past it. After
``max_rollbacks`` rollbacks the next one stops the run with an error instead.
"""
from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from torchtitan_lite.config.spike_policy import SpikePolicyConfig
from torchtitan_lite.loss_health import LossHealth

STATE_FORMAT = 1


class SpikeError(RuntimeError):
    """A loss spike the policy cannot get past; the message names the steps, what was tried and the fix."""


@dataclass(frozen=True)
class Verdict:
    """What happens to one step's update."""

    action: Literal["apply", "skip", "rollback", "overflow"]
    z_score: float | None = None
    """The largest z-score over the watched signals; None while the detector is not armed."""
    reason: str = ""

    @property
    def updates(self) -> bool:
        """The optimizer step runs (for 'overflow' the FP16 scaler then skips it, as it always does)."""
        return self.action in ("apply", "overflow")


@dataclass(frozen=True)
class RollbackPlan:
    to_step: int
    """The checkpoint the run goes back to."""
    spike_steps: tuple[int, ...]
    first_data_step: int
    """The batches of steps first_data_step..last_data_step (of the run before the rollback) are skipped."""
    last_data_step: int

    @property
    def data_steps(self) -> int:
        return self.last_data_step - self.first_data_step + 1


class SpikeGuard:
    """The detector, its skip and rollback counts, and the data windows to skip; checkpointed as state."""

    def __init__(self, config: SpikePolicyConfig, health: LossHealth) -> None:
        self.config = config
        self.health = health
        """Which checkpoints are known good; its state is saved with this guard's."""
        self.history: dict[str, deque[float]] = {s: deque(maxlen=config.window) for s in config.signals}
        self.spike_steps: list[int] = []
        """The current run of consecutive spiking steps."""
        self.skips_since_rollback = 0
        self.skipped_total = 0
        self.rollbacks = 0
        self.pending_data_skip: tuple[int, int] | None = None
        """(first, last) step whose batches are skipped when training reaches step ``first`` again."""
        self.data_skips: list[tuple[int, int]] = []
        """Windows already skipped, for the record."""
        self.last_z: float | None = None

    # ----------------------------------------------------------------------------------------------
    # Judging a step

    def judge(self, step: int, values: dict[str, float], *, overflow: bool = False) -> Verdict:
        """The fate of step ``step``'s update given its (rank-agreed) loss and gradient norm."""
        if overflow and math.isfinite(values["loss"]):
            return Verdict("overflow", reason="FP16 overflow, skipped by the loss scaler")
        cfg = self.config
        z, worst = self._largest_z(values)
        self.last_z = z
        if z is None or z <= cfg.k_sigma:
            for signal in cfg.signals:
                self.history[signal].append(values[signal])
            self.spike_steps = []
            return Verdict("apply", z)
        self.spike_steps.append(step)
        reason = self._describe(worst, values[worst])
        too_many_in_a_row = len(self.spike_steps) > cfg.max_consecutive_skips
        too_many_in_all = cfg.max_total_skips >= 0 and self.skips_since_rollback + 1 > cfg.max_total_skips
        if too_many_in_a_row or too_many_in_all:
            limit = (f"{len(self.spike_steps)} spiking steps in a row exceed training.spike_policy."
                     f"max_consecutive_skips={cfg.max_consecutive_skips}" if too_many_in_a_row else
                     f"{self.skips_since_rollback + 1} skipped steps exceed training.spike_policy.max_total_skips="
                     f"{cfg.max_total_skips}")
            return Verdict("rollback", z, f"{reason}; {limit}")
        self.skips_since_rollback += 1
        self.skipped_total += 1
        return Verdict("skip", z, f"{reason}; update skipped ({len(self.spike_steps)} of "
                                  f"{cfg.max_consecutive_skips} in a row allowed)")

    def _largest_z(self, values: dict[str, float]) -> tuple[float | None, str]:
        """The largest z-score over the watched signals and its signal, None when no signal has
        ``min_history`` values yet. A non-finite loss or norm, watched or not, is inf: applying its
        update would put non-finite values into the weights."""
        for signal, value in values.items():
            if not math.isfinite(value):
                return math.inf, signal
        best: float | None = None
        worst = self.config.signals[0]
        for signal in self.config.signals:
            z = self._z(signal, values[signal])
            if z is not None and (best is None or z > best):
                best, worst = z, signal
        return best, worst

    def _z(self, signal: str, value: float) -> float | None:
        recent = self.history[signal]
        if len(recent) < self.config.min_history:
            return None
        mean, std = _mean_std(recent)
        # Identical recent values (std 0) make any larger value infinitely unusual; a floor relative to
        # the mean keeps float rounding from counting as a spike.
        return (value - mean) / max(std, 1e-12 * max(abs(mean), 1.0))

    def _describe(self, signal: str, value: float) -> str:
        if not math.isfinite(value):
            return f"{signal} is {value}"
        mean, std = _mean_std(self.history[signal])
        return (f"{signal} {value:.4g} is {(value - mean) / max(std, 1e-12):.1f} sigma above its running mean "
                f"{mean:.4g} (std {std:.3g}, {len(self.history[signal])} steps; training.spike_policy.k_sigma="
                f"{self.config.k_sigma:g})")

    # ----------------------------------------------------------------------------------------------
    # Rolling back

    def plan_rollback(self, complete_steps: list[int]) -> RollbackPlan:
        """Where to go back to and which batches to skip; raises ``SpikeError`` when the run must stop."""
        cfg = self.config
        first, last = self.spike_steps[0], self.spike_steps[-1]
        steps = f"step {first}" if first == last else f"steps {first}-{last}"
        if self.rollbacks >= cfg.max_rollbacks:
            tried = (f"after {self.rollbacks} rollback(s), training.spike_policy.max_rollbacks={cfg.max_rollbacks}"
                     if cfg.max_rollbacks else "training.spike_policy.max_rollbacks=0 (skip only)")
            raise SpikeError(f"loss spike at {steps} goes on past the skip limits {tried}; stopping without "
                             f"saving. {self._fixes()}")
        good = [s for s in complete_steps if s < first and s in self.health.good_checkpoints]
        if not good:
            raise SpikeError(f"loss spike at {steps} goes on past the skip limits, and no complete checkpoint "
                             f"before step {first} is known good to roll back to (complete: {complete_steps or 'none'}; "
                             f"checkpoint N is good once step N+1 trained to a normal loss); stopping without "
                             f"saving. Checkpoint more often (checkpoint.interval) or {self._fixes()}")
        target = max(good)
        return RollbackPlan(to_step=target, spike_steps=tuple(self.spike_steps),
                            first_data_step=max(target + 1, first - cfg.rollback_skip_before),
                            last_data_step=last + cfg.rollback_skip_after)

    def _fixes(self) -> str:
        return ("Lower optimizer.lr or lengthen lr_scheduler.warmup_steps, clip gradients (training.max_norm), "
                "check the data of these steps, or raise the limits of training.spike_policy")

    def roll_back(self, plan: RollbackPlan, restore: Callable[[int], None]) -> None:
        """``restore(step)`` reloads every state from checkpoint ``step``, this guard's included; what
        belongs to the whole run (counts, windows, the good checkpoints up to the target) is kept."""
        skipped_total, rollbacks, data_skips = self.skipped_total, self.rollbacks, list(self.data_skips)
        good = {s for s in self.health.good_checkpoints if s <= plan.to_step}
        restore(plan.to_step)
        self.skipped_total, self.rollbacks, self.data_skips = skipped_total, rollbacks + 1, data_skips
        self.health.good_checkpoints |= good
        self.spike_steps, self.skips_since_rollback = [], 0
        self.pending_data_skip = (plan.first_data_step, plan.last_data_step)

    def adopt_recorded(self, records: list[dict[str, Any]], loaded_step: int) -> None:
        """After a resume: a rollback recorded in the checkpoint folder that went back to exactly the
        loaded checkpoint, and that the loaded state predates, still owes its data skip."""
        newer = [r for r in records if int(r["rollback"]) > self.rollbacks]
        if not newer:
            return
        self.rollbacks = max(int(r["rollback"]) for r in newer)
        for record in newer:
            if int(record["to_step"]) == loaded_step:
                first, last = (int(s) for s in record["skip_data_of_steps"])
                self.pending_data_skip = (first, last)
                self.spike_steps, self.skips_since_rollback = [], 0

    def data_to_skip(self, step: int) -> tuple[int, int] | None:
        """(first, last) step whose batches are to be dropped before step ``step`` takes its own; once."""
        if self.pending_data_skip is None or self.pending_data_skip[0] != step:
            return None
        window, self.pending_data_skip = self.pending_data_skip, None
        self.data_skips.append(window)
        return window

    # ----------------------------------------------------------------------------------------------
    # Checkpointing

    def state_dict(self) -> dict[str, Any]:
        return {
            "format": STATE_FORMAT,
            "history": {s: list(v) for s, v in self.history.items()},
            "spike_steps": list(self.spike_steps),
            "skips_since_rollback": self.skips_since_rollback,
            "skipped_total": self.skipped_total,
            "rollbacks": self.rollbacks,
            "pending_data_skip": None if self.pending_data_skip is None else list(self.pending_data_skip),
            "data_skips": [list(w) for w in self.data_skips],
            "last_z": self.last_z,
            "health": self.health.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("format") != STATE_FORMAT:
            raise ValueError(f"spike guard state has format {state.get('format')!r}, this version reads "
                             f"{STATE_FORMAT}; exclude 'spike_guard' from checkpoint loading to start it fresh")
        saved = state["history"]
        self.history = {s: deque((float(v) for v in saved.get(s, [])), maxlen=self.config.window)
                        for s in self.config.signals}
        self.spike_steps = [int(s) for s in state["spike_steps"]]
        self.skips_since_rollback = int(state["skips_since_rollback"])
        self.skipped_total = int(state["skipped_total"])
        self.rollbacks = int(state["rollbacks"])
        pending = state["pending_data_skip"]
        self.pending_data_skip = None if pending is None else (int(pending[0]), int(pending[1]))
        self.data_skips = [(int(a), int(b)) for a, b in state["data_skips"]]
        self.last_z = state["last_z"]
        self.health.load_state_dict(state["health"])

    def scalars(self, *, z_score: float | None = None) -> dict[str, float]:
        """TensorBoard values under spike/; the z-score is ``z_score`` when given (a rollback's spike, judged
        before the restored detector replaced it), else the latest step's."""
        values = {"spike/skipped_steps": float(self.skipped_total), "spike/rollbacks": float(self.rollbacks)}
        z = self.last_z if z_score is None else z_score
        if z is not None and math.isfinite(z):
            values["spike/z_score"] = float(z)
        return values


def _mean_std(values: deque[float]) -> tuple[float, float]:
    n = len(values)
    mean = sum(values) / n
    return mean, math.sqrt(sum((x - mean) ** 2 for x in values) / (n - 1))
