"""The ``training.spike_policy`` section: when a loss or gradient-norm spike skips a step's update and when
it rolls the run back. The guard that applies it is ``torchtitan_lite/spike_guard.py``; the section lives
here, with the other config sections, so the config imports nothing above it."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

Signal = Literal["loss", "grad_norm"]
SIGNALS: tuple[Signal, ...] = ("loss", "grad_norm")


@dataclass(kw_only=True)
class SpikePolicyConfig:
    enable: bool = False
    """Skip the optimizer update of a step whose loss (or gradient norm) spikes above its running mean;
    past the skip limits roll back to the last good checkpoint and skip the batches around the spike."""
    signals: list[Signal] = field(default_factory=lambda: ["loss"])
    """What is watched: 'loss' (the step's loss over all data-parallel ranks) and/or 'grad_norm' (the
    gradient norm before clipping). A spike in any of them counts."""
    k_sigma: float = 6.0
    """A value more than k_sigma running standard deviations above the running mean is a spike."""
    window: int = 100
    """The running mean and std cover the values of the last this many applied (not skipped) steps."""
    min_history: int = 20
    """The detector arms once this many applied steps are in the window (a non-finite loss or gradient
    norm is a spike before that too)."""
    max_consecutive_skips: int = 5
    """Spiking steps in a row that are skipped; the next one rolls back (0: roll back at the first spike)."""
    max_total_skips: int = -1
    """Skipped steps allowed since the start of the run or the last rollback, -1 for no limit; one more
    rolls back."""
    max_rollbacks: int = 3
    """Rollbacks allowed in a run; one more stops it with an error. 0 only skips: past the skip limits the
    run stops. Rolling back needs checkpoint.enable."""
    rollback_skip_before: int = 100
    """On rollback, also skip the batches of this many steps before the first spiking step (never those
    before the checkpoint rolled back to)."""
    rollback_skip_after: int = 100
    """On rollback, also skip the batches of this many steps after the last spiking step."""

    def __post_init__(self) -> None:
        prefix = "training.spike_policy"
        if not self.signals or len(set(self.signals)) != len(self.signals):
            raise ValueError(f"{prefix}.signals={self.signals} must name each of {list(SIGNALS)} at most once, "
                             f"and at least one")
        if not (self.k_sigma > 0 and math.isfinite(self.k_sigma)):
            raise ValueError(f"{prefix}.k_sigma={self.k_sigma} must be a number > 0 (e.g. 6: six standard "
                             f"deviations above the running mean)")
        if self.window < 2:
            raise ValueError(f"{prefix}.window={self.window} must be >= 2 (a standard deviation needs two values)")
        if not 2 <= self.min_history <= self.window:
            raise ValueError(f"{prefix}.min_history={self.min_history} must be between 2 and "
                             f"{prefix}.window={self.window}")
        for name in ("max_consecutive_skips", "max_rollbacks", "rollback_skip_before", "rollback_skip_after"):
            if getattr(self, name) < 0:
                raise ValueError(f"{prefix}.{name}={getattr(self, name)} must be >= 0")
        if self.max_total_skips < -1:
            raise ValueError(f"{prefix}.max_total_skips={self.max_total_skips} must be >= 0, or -1 for no limit")
