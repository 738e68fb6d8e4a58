"""The spike detector's decisions, limits, rollback plan and state, and the policy's parse-time errors."""
from __future__ import annotations

import io
import math

import pytest
import torch

import models  # noqa: F401  (registers the model families)
from config_registry import DEFAULT_REGISTRY
from torchtitan_lite.config import ConfigError, parse_cli
from torchtitan_lite.config.spike_policy import SpikePolicyConfig
from torchtitan_lite.loss_health import LossHealth
from torchtitan_lite.spike_guard import SpikeError, SpikeGuard

STEADY = [4.0, 4.2, 3.9, 4.1, 4.0, 3.8]
"""Mean 4.0, sample std 0.1414: a loss of 4.9 is 6.4 sigma above it."""


def _guard(**fields) -> SpikeGuard:
    fields = {"enable": True, "min_history": 4, "window": 6, **fields}
    return SpikeGuard(SpikePolicyConfig(**fields), LossHealth())


def _feed(guard: SpikeGuard, losses: list[float], first_step: int = 1) -> list[str]:
    return [guard.judge(first_step + i, {"loss": x, "grad_norm": 1.0}).action for i, x in enumerate(losses)]


def test_spikes_are_judged_against_the_applied_steps_only():
    guard = _guard(k_sigma=6.0)
    assert _feed(guard, STEADY) == ["apply"] * 6
    verdict = guard.judge(7, {"loss": 4.9, "grad_norm": 1.0})
    assert verdict.action == "skip" and verdict.z_score == pytest.approx(6.364, abs=1e-3)
    assert "loss 4.9 is 6.4 sigma above its running mean 4 (std 0.141, 6 steps" in verdict.reason
    # The skipped value stays out of the statistics: the same loss is a spike again.
    assert guard.judge(8, {"loss": 4.9, "grad_norm": 1.0}).action == "skip"
    assert list(guard.history["loss"]) == STEADY
    assert guard.judge(9, {"loss": 4.8, "grad_norm": 1.0}).action == "apply"  # 5.7 sigma
    assert guard.skipped_total == 2 and guard.spike_steps == []


def test_the_detector_arms_after_min_history_but_non_finite_values_spike_at_once():
    guard = _guard(min_history=4)
    assert _feed(guard, [4.0, 4.1, 100.0]) == ["apply"] * 3  # not armed yet: 100 joins the history
    assert guard.judge(4, {"loss": math.nan, "grad_norm": 1.0}).action == "skip"
    assert guard.judge(5, {"loss": 4.0, "grad_norm": math.inf}).action == "skip"


def test_grad_norm_is_watched_when_asked():
    guard = _guard(signals=["loss", "grad_norm"])
    for step in range(1, 7):
        guard.judge(step, {"loss": 4.0 + 0.01 * step, "grad_norm": 1.0 + 0.01 * (step % 2)})
    verdict = guard.judge(7, {"loss": 4.0, "grad_norm": 5.0})
    assert verdict.action == "skip" and "grad_norm 5 is" in verdict.reason


def test_an_fp16_overflow_is_neither_a_spike_nor_a_sample():
    guard = _guard(max_consecutive_skips=1)
    _feed(guard, STEADY)
    assert guard.judge(7, {"loss": 50.0, "grad_norm": math.inf}, overflow=True).action == "overflow"
    assert guard.skipped_total == 0 and list(guard.history["loss"]) == STEADY and guard.spike_steps == []
    # A non-finite loss is more than an overflow of the gradients: a spike, counted here (the scaler only backs off).
    assert guard.judge(8, {"loss": math.inf, "grad_norm": math.inf}, overflow=True).action == "skip"


def test_consecutive_and_total_limits_turn_a_skip_into_a_rollback():
    guard = _guard(max_consecutive_skips=2)
    _feed(guard, STEADY)
    assert _feed(guard, [9.0, 9.0, 9.0], first_step=7) == ["skip", "skip", "rollback"]
    assert guard.spike_steps == [7, 8, 9] and guard.skipped_total == 2

    guard = _guard(max_consecutive_skips=5, max_total_skips=2)
    _feed(guard, STEADY)
    assert _feed(guard, [9.0, 4.0, 9.0, 4.0, 9.0], first_step=7) == ["skip", "apply", "skip", "apply", "rollback"]


def test_rollback_goes_to_the_newest_good_checkpoint_before_the_spike_and_skips_around_it():
    guard = _guard(max_consecutive_skips=1, rollback_skip_before=3, rollback_skip_after=10)
    guard.health.good_checkpoints = {10, 20, 30}
    guard.spike_steps = [32, 33]
    plan = guard.plan_rollback([10, 20, 30, 32])  # 32 is newer than the first spike
    assert (plan.to_step, plan.first_data_step, plan.last_data_step) == (30, 31, 43)  # before capped at 31
    guard.spike_steps = [38, 39]
    plan = guard.plan_rollback([10, 20, 25, 30])  # 25 is not known good
    assert (plan.to_step, plan.first_data_step, plan.last_data_step, plan.data_steps) == (30, 35, 49, 15)

    restored = []

    def restore(step: int) -> None:  # a checkpoint of step 30 holds the counts as they were then
        restored.append(step)
        guard.load_state_dict({**state_at_30, "health": {"recent": [4.0], "good_checkpoints": [10, 20]}})

    guard.skipped_total = 7
    state_at_30 = {**guard.state_dict(), "skipped_total": 3, "spike_steps": []}
    guard.roll_back(plan, restore)
    assert restored == [30]
    assert guard.rollbacks == 1 and guard.skipped_total == 7  # the run's counts, not the checkpoint's
    assert guard.health.good_checkpoints == {10, 20, 30} and guard.pending_data_skip == (35, 49)
    assert guard.data_to_skip(34) is None and guard.data_to_skip(35) == (35, 49) and guard.data_to_skip(35) is None
    assert guard.data_skips == [(35, 49)]


def test_rollback_that_cannot_happen_stops_with_the_reason():
    guard = _guard(max_rollbacks=1)
    guard.spike_steps = [12]
    with pytest.raises(SpikeError, match=r"no complete checkpoint before step 12 is known good to roll back to "
                                         r"\(complete: \[5, 10\]; checkpoint N is good once step N\+1 trained"):
        guard.plan_rollback([5, 10])
    guard.rollbacks = 1
    with pytest.raises(SpikeError, match=r"loss spike at step 12 goes on past the skip limits after 1 rollback\(s\), "
                                         r"training\.spike_policy\.max_rollbacks=1; stopping without saving"):
        guard.plan_rollback([5, 10])


def test_state_round_trips_through_a_weights_only_load():
    guard = _guard()
    _feed(guard, [*STEADY, 9.0])
    guard.health.observe(3, 4.0)
    guard.pending_data_skip, guard.data_skips, guard.rollbacks = (7, 12), [(2, 3)], 1
    buffer = io.BytesIO()
    torch.save(guard.state_dict(), buffer)
    buffer.seek(0)
    other = _guard()
    other.load_state_dict(torch.load(buffer, weights_only=True))
    assert other.state_dict() == guard.state_dict()
    assert other.judge(8, {"loss": 9.0, "grad_norm": 1.0}).action == "skip"  # same statistics, same verdict


def test_a_recorded_rollback_newer_than_the_loaded_state_still_owes_its_data_skip():
    records = [{"rollback": 1, "to_step": 6, "spike_steps": [8, 9], "skip_data_of_steps": [7, 10]}]
    guard = _guard()
    guard.adopt_recorded(records, loaded_step=6)
    assert guard.rollbacks == 1 and guard.pending_data_skip == (7, 10)
    later = _guard()
    later.rollbacks = 1  # a checkpoint saved after that rollback already holds it
    later.adopt_recorded(records, loaded_step=12)
    assert later.pending_data_skip is None


@pytest.mark.parametrize("flag, value, text", [
    ("k_sigma", "0", r"training\.spike_policy\.k_sigma=0\.0 must be a number > 0"),
    ("k_sigma", "nan", r"training\.spike_policy\.k_sigma=nan must be a number > 0"),
    ("window", "1", r"training\.spike_policy\.window=1 must be >= 2"),
    ("min_history", "200", r"training\.spike_policy\.min_history=200 must be between 2 and training\.spike_policy\.window=100"),
    ("max_consecutive_skips", "-1", r"training\.spike_policy\.max_consecutive_skips=-1 must be >= 0"),
    ("max_rollbacks", "-2", r"training\.spike_policy\.max_rollbacks=-2 must be >= 0"),
    ("max_total_skips", "-2", r"training\.spike_policy\.max_total_skips=-2 must be >= 0, or -1 for no limit"),
    ("rollback_skip_after", "-5", r"training\.spike_policy\.rollback_skip_after=-5 must be >= 0"),
    ("signals", "loss,loss", r"training\.spike_policy\.signals=\['loss', 'loss'\] must name each"),
])
def test_bad_values_are_refused_at_parse_time(flag, value, text):
    with pytest.raises(ConfigError, match=rf"invalid value for --training\.spike_policy\.{flag}: {text}"):
        parse_cli(["--config", "llama3_debug", f"--training.spike_policy.{flag}", value], registry=DEFAULT_REGISTRY)


def test_rollback_without_checkpointing_is_refused_at_parse_time():
    argv = ["--config", "llama3_debug", "--training.spike_policy.enable", "true", "--checkpoint.enable", "false"]
    with pytest.raises(ConfigError, match=r"training\.spike_policy\.max_rollbacks=3 rolls back to the last good "
                                          r"checkpoint, but checkpoint\.enable=false: set --checkpoint\.enable true .* "
                                          r"or --training\.spike_policy\.max_rollbacks 0 to only skip"):
        parse_cli(argv, registry=DEFAULT_REGISTRY)
    config = parse_cli([*argv, "--training.spike_policy.max_rollbacks", "0"], registry=DEFAULT_REGISTRY).config
    assert config.training.spike_policy.enable and config.training.spike_policy.max_rollbacks == 0
