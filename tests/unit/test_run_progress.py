"""torchtitan_lite/tools/run_progress.py: loss_compare's progress lines, throttled, with a time left that
start-up does not inflate."""
from __future__ import annotations

from torchtitan_lite.tools.run_progress import ProgressReporter, format_duration


def _step_line(step: int) -> str:
    return (f"[rank0] 13:39:11 INFO torchtitan_lite: step {step:6d}  loss   5.5218  grad_norm  1.0378  "
            f"lr 2.985e-03  memory 0.86GiB  tok/s 1,114 (global 1,114)  mfu 3.77%  eta 8m37s\n")


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_one_line_at_the_first_step_then_at_most_every_interval_and_at_the_last():
    clock, lines = FakeClock(), []
    progress = ProgressReporter("run 2/12 fp8 seed 1", None, interval_s=30.0, clock=clock, emit=lines.append)
    clock.now += 40.0  # start-up: imports, model build
    progress.feed("[rank0] INFO torchtitan_lite: training 200 steps from step 0, 1 micro-batch(es) per step\n")
    for step in range(1, 201):
        clock.now += 2.0  # 2 s per step, so 15 steps between two lines
        progress.feed(_step_line(step))
        progress.feed("[rank0] INFO torchtitan_lite: validation loss 4.2\n")
    # Step 1 at 42 s; then steps 16, 31, ..., 196 (each 30 s after the previous line); then step 200.
    assert len(lines) == 1 + 13 + 1 and progress.lines_emitted == 15
    assert lines[0] == "[loss_compare] run 2/12 fp8 seed 1: step 1/200, 42s elapsed, ETA ?"
    # From step 1 on, 2 s per step: 184 steps left at step 16.
    assert lines[1] == "[loss_compare] run 2/12 fp8 seed 1: step 16/200, 1m12s elapsed, ETA 6m08s"
    assert lines[-1] == "[loss_compare] run 2/12 fp8 seed 1: step 200/200, 7m20s elapsed, ETA 0s"


def test_known_total_and_no_throttle():
    clock, lines = FakeClock(), []
    progress = ProgressReporter("a", 3, interval_s=0.0, clock=clock, emit=lines.append)
    for step in (1, 2, 3):
        clock.now += 1.0
        progress.feed(_step_line(step))
    assert [line.split(": ")[1] for line in lines] == ["step 1/3, 1s elapsed, ETA ?", "step 2/3, 2s elapsed, ETA 1s",
                                                        "step 3/3, 3s elapsed, ETA 0s"]


def test_durations():
    assert [format_duration(s) for s in (0, 59.4, 60, 125, 3725)] == ["0s", "59s", "1m00s", "2m05s", "62m05s"]
