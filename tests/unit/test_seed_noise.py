"""torchtitan_lite/tools/seed_noise.py: a recipe's loss gap against the baseline's seed-to-seed spread, on
synthetic curves whose window means are known exactly."""
from __future__ import annotations

import math
import random
import statistics

import pytest

from torchtitan_lite.tools import seed_noise

STEPS = range(1, 41)
LAST = 20


def _batch_noise(seed: int) -> dict[int, float]:
    """Per-step difficulty of the batches one seed draws: +-1.5 nats, the same for every config of that seed
    (one seed gives every config the same batch order)."""
    rng = random.Random(1000 + seed)
    return {s: rng.uniform(-1.5, 1.5) for s in STEPS}


def _curve(seed: int, offset: float) -> dict[int, float]:
    """A falling loss + the seed's batch noise + a constant ``offset`` over the whole run."""
    noise = _batch_noise(seed)
    return {s: 5.0 - 0.02 * s + noise[s] + offset for s in STEPS}


def _runs(base_offsets, **recipes) -> dict[str, dict[str, dict[int, float]]]:
    runs = {"bf16": {str(i): _curve(i, off) for i, off in enumerate(base_offsets)}}
    for label, offsets in recipes.items():
        runs[label] = {str(i): _curve(i, off) for i, off in enumerate(offsets)}
    return runs


def test_band_gap_and_error_are_the_documented_statistics():
    # bf16 window means differ by the seed's batch noise + offsets 0, 0.1, 0.2; "biased" runs 0.2, 0.3, 0.25
    # above bf16 on the same seeds, so its per-seed gaps are exactly those (the batch noise cancels).
    runs = _runs([0.0, 0.1, 0.2], biased=[0.2, 0.4, 0.45])
    window, (v,) = seed_noise.judge(runs, LAST)
    assert window == list(range(21, 41))
    base_means = [sum(runs["bf16"][str(i)][s] for s in window) / LAST for i in range(3)]
    # Float sums of 20 values: 1e-12.
    assert v.band == pytest.approx(statistics.stdev(base_means), abs=1e-12)
    assert v.seeds == ["0", "1", "2"]
    assert list(v.seed_gaps.values()) == pytest.approx([0.2, 0.3, 0.25], abs=1e-12)
    assert v.mean_gap == pytest.approx(0.25, abs=1e-12)
    assert v.std_error == pytest.approx(0.05 / math.sqrt(3), abs=1e-12)


def test_a_biased_recipe_is_beyond_noise_and_a_noisy_unbiased_one_is_not():
    # bf16's own seed-to-seed spread: the batch noise of each seed's window plus offsets 0, +0.03, -0.03.
    base = [0.0, 0.03, -0.03]
    runs = _runs(base,
                 biased=[b + 0.3 + d for b, d in zip(base, (0.01, -0.01, 0.0))],
                 unbiased_noisy=[b + d for b, d in zip(base, (0.12, -0.1, -0.03))],
                 small_bias=[b + 0.02 + d for b, d in zip(base, (0.001, -0.001, 0.0))])
    _, verdicts = seed_noise.judge(runs, LAST)
    by_label = {v.label: v for v in verdicts}
    band = by_label["biased"].band
    # The seeds' batch noise dominates the band: ~0.16 nats, well above the 0.03 offsets.
    assert 0.05 < band < 0.5
    assert by_label["biased"].beyond_noise and by_label["biased"].verdict == "beyond noise"
    assert by_label["biased"].mean_gap == pytest.approx(0.3, abs=1e-12)
    noisy = by_label["unbiased_noisy"]
    assert not noisy.beyond_noise and noisy.verdict == "within noise"
    assert noisy.mean_gap == pytest.approx(-0.01 / 3, abs=1e-12)
    # Consistent over the seeds (error 0.0006) but smaller than what a change of seed does: within noise.
    small = by_label["small_bias"]
    assert small.std_error < 0.001 and not small.beyond_noise


def test_a_gap_beyond_the_band_but_not_by_its_error_is_within_noise():
    base = [0.0, 0.03, -0.03]
    runs = _runs(base)
    band = seed_noise.noise_band(runs["bf16"], list(range(21, 41)))
    # Mean gap band + 0.05, standard error > 0.05: the interval reaches into the band.
    spread = (0.3, -0.3, 0.0)
    runs["wobbly"] = {str(i): _curve(i, b + band + 0.05 + d) for i, (b, d) in enumerate(zip(base, spread))}
    _, (v,) = seed_noise.judge(runs, LAST)
    assert v.mean_gap == pytest.approx(band + 0.05, abs=1e-12)
    assert v.std_error == pytest.approx(0.3 / math.sqrt(3), abs=1e-12)
    assert not v.beyond_noise


def test_one_seed_has_no_spread():
    with pytest.raises(ValueError, match="the baseline has 1 seed"):
        seed_noise.judge(_runs([0.0], fp8=[0.1]), LAST)
    runs = _runs([0.0, 0.1, 0.2])
    runs["fp8"] = {"2": _curve(2, 0.3), "7": _curve(7, 0.3)}
    with pytest.raises(ValueError, match=r"fp8 shares 1 seed\(s\) with bf16 .*needs at least 2"):
        seed_noise.judge(runs, LAST)
