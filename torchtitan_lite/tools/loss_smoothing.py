"""Exponential moving average of a loss curve, for plotting it over the raw per-batch losses.

A per-batch training loss swings by more than a nat between batches on small data (the batches come from
different source files), which hides a few-hundredths gap between two recipes; the smoothed curve shows the
trend. It is the bias-corrected EMA (as Adam corrects its moments, and TensorBoard's smoothing slider): with
``s_0 = 0`` and ``s_k = beta * s_{k-1} + (1 - beta) * x_k``, the plotted value is ``s_k / (1 - beta**k)``, the
weighted mean of ``x_1..x_k`` with weights ``beta**(k-i)``. Without the correction the curve would start at
``(1 - beta) * x_1``, near zero. Its effective window is ``1 / (1 - beta)`` points (10 for beta 0.9).

The gap statistics of loss_compare do not use it: an EMA at step t still carries steps before the averaging
window, weighted unequally; they average the raw losses over the window instead (see seed_noise.py).
"""
from __future__ import annotations


def ema(values: list[float], beta: float) -> list[float]:
    """Bias-corrected exponential moving average of ``values`` (in order); ``beta`` 0 returns them unchanged."""
    if not 0.0 <= beta < 1.0:
        raise ValueError(f"the smoothing factor must be in [0, 1), got {beta}")
    smoothed, state = [], 0.0
    for k, value in enumerate(values, start=1):
        state = beta * state + (1.0 - beta) * value
        smoothed.append(state / (1.0 - beta**k))
    return smoothed


def ema_curve(curve: dict[int, float], beta: float) -> dict[int, float]:
    """``ema`` over a step -> loss curve, in step order (a gap in the logged steps counts as one step)."""
    steps = sorted(curve)
    return dict(zip(steps, ema([curve[s] for s in steps], beta)))
