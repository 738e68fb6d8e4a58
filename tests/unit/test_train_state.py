"""The loop's resumable state: the logged loss is the mean since the last log line, across a resume too."""
from __future__ import annotations

import io

import pytest
import torch

from torchtitan_lite.train_state import TrainState


def test_the_logged_loss_is_the_mean_of_the_steps_since_the_last_log_line():
    state = TrainState()
    for loss in (4.0, 6.0, 8.0):
        state.add_loss(loss)
    assert state.take_mean_loss(fallback=99.0) == pytest.approx(6.0)
    # A fresh interval; one without an applied step (all skipped) logs the step's own value.
    assert state.take_mean_loss(fallback=3.5) == 3.5
    state.add_loss(2.0)
    assert state.take_mean_loss(fallback=99.0) == 2.0


def test_a_half_done_interval_survives_a_checkpoint():
    state = TrainState(step=7)
    state.add_loss(4.0)
    state.add_loss(5.0)
    buffer = io.BytesIO()
    torch.save(state.state_dict(), buffer)
    buffer.seek(0)
    resumed = TrainState()
    resumed.load_state_dict(torch.load(buffer, weights_only=True))
    resumed.add_loss(6.0)
    assert (resumed.step, resumed.take_mean_loss(fallback=0.0)) == (7, pytest.approx(5.0))
    # A checkpoint from before the interval was saved starts a fresh one.
    old = {k: v for k, v in state.state_dict().items() if not k.startswith("loss_")}
    fresh = TrainState()
    fresh.load_state_dict(old)
    assert (fresh.loss_sum, fresh.loss_steps) == (0.0, 0)
