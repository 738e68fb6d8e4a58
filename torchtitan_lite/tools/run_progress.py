"""Progress lines for a training run whose console output goes to a log file.

loss_compare trains its configs one after another with the console output in each run's train.log; this
reads that output as it is written and prints, per run, a line at its first step, then at most one every
``interval_s`` seconds, and one at its last step: which run, step k/N, the time since it started and the
time left. The time left is measured from the first logged step on, so start-up (imports, model build,
compile) does not inflate it.
"""
from __future__ import annotations

import re
import time
from collections.abc import Callable

STEP_LINE = re.compile(r"\bstep\s+(\d+)\s+loss\b")
"""The trainer's per-step console line: ``step     40  loss   5.1892  grad_norm ...``."""
TOTAL_LINE = re.compile(r"\btraining (\d+) steps from step \d+")
"""The trainer's announcement of the run's length, for runs whose step count loss_compare did not set."""


def format_duration(seconds: float) -> str:
    seconds = max(0, round(seconds))
    return f"{seconds // 60}m{seconds % 60:02d}s" if seconds >= 60 else f"{seconds}s"


class ProgressReporter:
    """Turns a run's console lines into throttled progress lines (``feed`` each line, in order)."""

    def __init__(self, label: str, total: int | None, *, interval_s: float = 30.0,
                 clock: Callable[[], float] = time.monotonic, emit: Callable[[str], None] = print) -> None:
        self.label, self.total, self.interval_s = label, total, interval_s
        self._clock, self._emit = clock, emit
        self._start = clock()
        self._first: tuple[float, int] | None = None
        """(time, step) of the first logged step: the rate is measured from there."""
        self._last_emit = -float("inf")
        self.lines_emitted = 0

    def feed(self, line: str) -> None:
        if self.total is None and (total := TOTAL_LINE.search(line)):
            self.total = int(total.group(1))
        if step := STEP_LINE.search(line):
            self._on_step(int(step.group(1)))

    def _on_step(self, step: int) -> None:
        now = self._clock()
        if self._first is None:
            self._first = (now, step)
        elif step != self.total and now - self._last_emit < self.interval_s:
            return
        self._last_emit = now
        self.lines_emitted += 1
        self._emit(f"[loss_compare] {self.label}: step {step}/{self.total or '?'}, "
                   f"{format_duration(now - self._start)} elapsed, ETA {self._eta(step, now)}")

    def _eta(self, step: int, now: float) -> str:
        assert self._first is not None
        first_time, first_step = self._first
        if self.total is None or step <= first_step:
            return "?"
        per_step = (now - first_time) / (step - first_step)
        return format_duration(per_step * (self.total - step))
