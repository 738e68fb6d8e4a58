"""Which checkpoints are known good: those whose next step trained to a finite, unremarkable loss.

A checkpoint of step N holds the weights after update N; the loss that shows whether that update
blew the weights up is step N+1's. So "finite loss at step N" says nothing about checkpoint N (with
a huge learning rate the loss of step 1 is fine and the weights saved after it are not). Checkpoint
N counts as good only once step N+1's loss was finite and within the spike bounds: no more than
``max_ratio`` times the running mean of the recent losses and, once ``min_history`` losses are in,
no more than ``k_sigma`` standard deviations above it.
"""
from __future__ import annotations

import math
from collections import deque


class LossHealth:
    def __init__(self, *, k_sigma: float = 6.0, max_ratio: float = 3.0, window: int = 100, min_history: int = 10) -> None:
        self.k_sigma, self.max_ratio, self.min_history = k_sigma, max_ratio, min_history
        self.recent: deque[float] = deque(maxlen=window)
        self.good_checkpoints: set[int] = set()

    def bounds(self) -> float:
        """Largest loss that still counts as normal after the recent losses; inf before any."""
        if not self.recent:
            return math.inf
        mean = sum(self.recent) / len(self.recent)
        bound = self.max_ratio * mean if mean > 0 else math.inf
        if len(self.recent) >= self.min_history:
            std = math.sqrt(sum((x - mean) ** 2 for x in self.recent) / (len(self.recent) - 1))
            bound = min(bound, mean + self.k_sigma * std)
        return bound

    def is_normal(self, loss: float) -> bool:
        return math.isfinite(loss) and loss <= self.bounds()

    def observe(self, step: int, loss: float) -> bool:
        """Record step ``step``'s loss; returns whether it was normal. A normal loss vouches for the
        checkpoint of step ``step - 1`` and joins the running statistics, an abnormal one does neither."""
        normal = self.is_normal(loss)
        if normal:
            self.recent.append(loss)
            self.good_checkpoints.add(step - 1)
        return normal

    def last_good(self, complete_steps: list[int]) -> int | None:
        """Newest of ``complete_steps`` known good in this run, None when none is."""
        good = [s for s in complete_steps if s in self.good_checkpoints]
        return max(good) if good else None

    def state_dict(self) -> dict[str, list]:
        return {"recent": list(self.recent), "good_checkpoints": sorted(self.good_checkpoints)}

    def load_state_dict(self, state: dict[str, list]) -> None:
        self.recent = deque((float(x) for x in state["recent"]), maxlen=self.recent.maxlen)
        self.good_checkpoints = {int(s) for s in state["good_checkpoints"]}
