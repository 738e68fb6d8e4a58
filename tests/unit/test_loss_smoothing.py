"""torchtitan_lite/tools/loss_smoothing.py: the bias-corrected EMA drawn over loss_compare's raw curves."""
from __future__ import annotations

import pytest

from torchtitan_lite.tools.loss_smoothing import ema, ema_curve


def test_bias_correction_makes_each_point_a_weighted_mean_of_the_points_so_far():
    # beta 0.5 over [0, 1, 4]: weights 0.25, 0.5, 1 -> (0 + 0.5 + 4) / 1.75; without the correction the
    # first point would be 0.5 * 0 and the second 0.25 * 0 + 0.5 * 1 = 0.5 (here 1 / 1.5).
    assert ema([0.0, 1.0, 4.0], 0.5) == pytest.approx([0.0, 1.0 / 1.5, 4.5 / 1.75], abs=1e-12)
    # A constant curve is left as it is from its first point (float arithmetic: 1e-12).
    assert ema([3.7] * 50, 0.9) == pytest.approx([3.7] * 50, abs=1e-12)
    assert ema([5.0, 1.0, 2.0], 0.0) == [5.0, 1.0, 2.0]


def test_smoothing_damps_batch_noise_and_keeps_the_trend():
    # +-1.5 nats alternating around a line falling 0.01 per step: in steady state the EMA's residual
    # swing is 1.5 * (1 - beta) / (1 + beta) = 0.0789 for beta 0.9, while its lag behind the line is
    # 0.01 * beta / (1 - beta) = 0.09 (the price of smoothing a trend).
    trend = [5.0 - 0.01 * k for k in range(400)]
    noisy = [t + (1.5 if k % 2 else -1.5) for k, t in enumerate(trend)]
    smoothed = ema(noisy, 0.9)
    residual = [s - t for s, t in zip(smoothed[200:], trend[200:])]
    # After 200 steps the start-up terms are below 0.9**200 ~ 7e-10 of the first value.
    assert max(residual) == pytest.approx(0.09 + 1.5 * 0.1 / 1.9, abs=1e-6)
    assert min(residual) == pytest.approx(0.09 - 1.5 * 0.1 / 1.9, abs=1e-6)


def test_curve_is_smoothed_in_step_order_and_bad_factors_are_refused():
    assert ema_curve({3: 4.0, 1: 0.0, 2: 1.0}, 0.5) == pytest.approx({1: 0.0, 2: 1.0 / 1.5, 3: 4.5 / 1.75})
    for beta in (1.0, -0.1):
        with pytest.raises(ValueError, match=r"smoothing factor must be in \[0, 1\)"):
            ema([1.0], beta)
