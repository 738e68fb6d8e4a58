import pytest
import torch
from torch import nn

from torchtitan_lite.components.lr_scheduler import LRSchedulersContainer
from torchtitan_lite.components.optimizer import OptimizersContainer

PEAK = 1e-3


def _build(schedule: LRSchedulersContainer.Config, steps: int, **optimizer_kwargs):
    optimizers = OptimizersContainer.Config(lr=PEAK, **optimizer_kwargs).build(model_parts=[nn.Linear(4, 4)])
    return optimizers, schedule.build(optimizers=optimizers, training_steps=steps)


def _lr_factors_per_step(schedule: LRSchedulersContainer.Config, steps: int, extra: int = 0) -> list[float]:
    """Factor of the peak lr that optimizer steps 1..steps+extra use, as the loop drives them."""
    optimizers, schedulers = _build(schedule, steps)
    factors = []
    for _ in range(steps + extra):
        factors.append(optimizers.lrs()[0] / PEAK)
        assert schedulers.last_lr == optimizers.lrs()[0]
        optimizers.step()  # no grads: a no-op that keeps LambdaLR's call-order check quiet
        schedulers.step()
    return factors


# 10 steps, 2 warmup steps, floor 0.1. Warmup: 1/3, 2/3. Values are exact up to float rounding.
@pytest.mark.parametrize(
    "decay_type, decay_ratio, expected",
    [
        # Constant: peak right after warmup.
        ("constant", None, {1: 1 / 3, 2: 2 / 3, 3: 1.0, 10: 1.0}),
        # Linear over the 8 post-warmup steps: p = (s - 2) / 8, f = 0.1 + 0.9 (1 - p).
        ("linear", None, {1: 1 / 3, 2: 2 / 3, 3: 0.1 + 0.9 * 7 / 8, 6: 0.55, 9: 0.1 + 0.9 / 8, 10: 0.1, 11: 0.1}),
        # Cosine over 8 steps: half-way (s = 6) is the mean of peak and floor.
        ("cosine", None, {3: 0.1 + 0.45 * (1 + 0.9238795325112867), 6: 0.55, 10: 0.1}),
        # Linear over the last 5 steps: stable for s = 3..5, then p = (s - 5) / 5.
        ("linear", 0.5, {3: 1.0, 5: 1.0, 6: 0.1 + 0.9 * 0.8, 10: 0.1}),
        # WSD over the last 4 steps with 1 - sqrt(p): s = 7 has p = 1/4, so g = 1/2.
        ("wsd", 0.4, {2: 2 / 3, 3: 1.0, 6: 1.0, 7: 0.55, 8: 0.1 + 0.9 * (1 - 0.5**0.5), 10: 0.1}),
    ],
)
def test_lr_at_chosen_steps(decay_type, decay_ratio, expected):
    schedule = LRSchedulersContainer.Config(
        warmup_steps=2, decay_type=decay_type, decay_ratio=decay_ratio, min_lr_factor=0.1
    )
    factors = _lr_factors_per_step(schedule, steps=10, extra=1)
    for step, factor in expected.items():
        # Tolerance: lr / PEAK loses a few ulps.
        assert factors[step - 1] == pytest.approx(factor, rel=1e-12, abs=1e-15), f"step {step}"


def test_no_warmup_starts_at_peak_and_decays_are_monotonic():
    for decay_type in ("linear", "cosine"):
        factors = _lr_factors_per_step(LRSchedulersContainer.Config(warmup_steps=0, decay_type=decay_type,
                                                                    min_lr_factor=0.0), steps=5)
        assert factors[-1] == 0.0
        assert all(a > b for a, b in zip(factors, factors[1:]))
        assert factors[0] < 1.0  # the first step is already 1/5 of the way down


def test_state_dict_resumes_mid_schedule_and_follows_the_new_config():
    schedule = LRSchedulersContainer.Config(warmup_steps=2, decay_type="linear")
    full = _lr_factors_per_step(schedule, steps=10)
    optimizers, schedulers = _build(schedule, steps=10)
    for _ in range(4):
        optimizers.step()
        schedulers.step()
    state = schedulers.state_dict()
    assert state == {"last_step": 4}

    resumed_opt, resumed = _build(schedule, steps=10)
    resumed.load_state_dict(state)
    assert resumed.last_step == 4
    resumed_factors = []
    for _ in range(6):
        resumed_factors.append(resumed_opt.lrs()[0] / PEAK)
        resumed_opt.step()
        resumed.step()
    assert resumed_factors == pytest.approx(full[4:], rel=1e-12)

    # The position is restored, the values come from the config: a resumed run may change lr.
    optimizers = OptimizersContainer.Config(lr=2 * PEAK).build(model_parts=[nn.Linear(4, 4)])
    doubled = schedule.build(optimizers=optimizers, training_steps=10)
    doubled.load_state_dict(state)
    assert doubled.last_lr == pytest.approx(2 * PEAK * full[4], rel=1e-12)


def test_every_optimizer_and_param_group_is_scheduled():
    parts = [nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4)), nn.Linear(4, 4)]
    optimizers = OptimizersContainer.Config(lr=PEAK).build(model_parts=parts)
    schedulers = LRSchedulersContainer.Config(warmup_steps=3).build(optimizers=optimizers, training_steps=10)
    assert len(schedulers.schedulers) == 2
    assert [g["lr"] for g in optimizers.param_groups] == pytest.approx([PEAK / 4] * 4)


def test_low_bit_optimizer_lr_stays_a_tensor_updated_in_place():
    # torchao's low-bit AdamW rejects a float lr; no parameter has a grad, so nothing compiles here.
    optimizers, schedulers = _build(LRSchedulersContainer.Config(warmup_steps=3), steps=10, low_bit="adamw8bit")
    lr_tensor = optimizers.param_groups[0]["lr"]
    assert isinstance(lr_tensor, torch.Tensor) and float(lr_tensor) == pytest.approx(PEAK / 4)
    optimizers.step()
    schedulers.step()
    assert optimizers.param_groups[0]["lr"] is lr_tensor
    assert float(lr_tensor) == pytest.approx(PEAK / 2)
    schedulers.load_state_dict({"last_step": 2})
    assert optimizers.param_groups[0]["lr"] is lr_tensor and schedulers.last_lr == pytest.approx(0.75 * PEAK)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"decay_type": "exp"}, r"lr_scheduler.decay_type must be one of \['constant', 'linear', 'cosine', 'wsd'\]"),
        ({"warmup_steps": -1}, r"lr_scheduler.warmup_steps must be >= 0, got -1"),
        ({"min_lr_factor": 1.5}, r"lr_scheduler.min_lr_factor must be in \[0, 1\], got 1.5"),
        ({"decay_ratio": 0.0}, r"lr_scheduler.decay_ratio must be in \(0, 1\] or None, got 0.0"),
        ({"decay_type": "wsd"}, r"decay_type='wsd' needs lr_scheduler.decay_ratio"),
        ({"decay_type": "constant", "decay_ratio": 0.2}, r"decay_type='constant' never decays"),
    ],
)
def test_config_rejects_bad_values(kwargs, message):
    with pytest.raises(ValueError, match=message):
        LRSchedulersContainer.Config(**kwargs)


def test_warmup_longer_than_a_short_run_is_shortened_with_a_warning(caplog):
    # A short run of a long-run config (--training.steps 10) must train, not fail.
    with caplog.at_level("WARNING"):
        _, schedulers = _build(LRSchedulersContainer.Config(warmup_steps=20), steps=10)
    assert "warmup_steps=20 does not fit in training.steps=10; warming up over 10 steps" in caplog.text
    assert (schedulers.warmup_steps, schedulers.decay_steps) == (10, 0)
    assert schedulers.lr_factor(10) == pytest.approx(10 / 11)
    caplog.clear()
    with caplog.at_level("WARNING"):
        _, schedulers = _build(LRSchedulersContainer.Config(warmup_steps=5, decay_type="wsd", decay_ratio=0.8), steps=10)
    assert "with 8 decay steps; warming up over 2 steps" in caplog.text
    assert (schedulers.warmup_steps, schedulers.decay_steps) == (2, 8)
    # Warmup may take the whole run.
    _, schedulers = _build(LRSchedulersContainer.Config(warmup_steps=10), steps=10)
    assert schedulers.decay_steps == 0
