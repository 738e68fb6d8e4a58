"""Is a recipe's loss gap to the baseline a bias, or what another seed would do anyway?

Each config trained over the same seeds (``training.seed``: it draws the initial weights and the order of
the training batches). The statistic of one run is its **window mean**: the mean raw loss over the last K
steps that every run logged (an average over K batches; a smoothed curve would also weigh steps before the
window). Then, per recipe:

- **noise band**: the baseline's seed-to-seed spread, the sample standard deviation (n - 1) of its window
  means over its seeds: how far one run's loss moves when only the seed changes.
- **mean gap**: the recipe's window mean averaged over the seeds it shares with the baseline, minus the
  baseline's averaged over the same seeds; positive means the recipe's loss is higher.
- **standard error** of the mean gap: from the per-seed gaps ``recipe[s] - baseline[s]`` (paired: one seed
  gives both runs the same initial weights and batches, so the batch-to-batch difficulty cancels in the
  gap), ``stdev(gaps) / sqrt(n)``.
- **verdict**: *beyond noise* when the whole interval mean gap ± standard error lies outside the band
  (``|mean gap| - standard error > band``): the recipe moves the loss by more than a change of seed does,
  and the seeds agree on it. Otherwise *within noise*.

Both need at least two seeds: one seed has no spread to measure.
"""
from __future__ import annotations

import math
import statistics
from dataclasses import dataclass

Curve = dict[int, float]
"""step -> loss of one run."""
SeedCurves = dict[str, Curve]
"""seed name -> that seed's curve, for one config."""


@dataclass(frozen=True)
class SeedVerdict:
    label: str
    seeds: list[str]
    """The seeds the recipe shares with the baseline; the gap and its error are taken over these."""
    seed_gaps: dict[str, float]
    """seed -> recipe's window mean minus the baseline's, that seed."""
    mean_gap: float
    std_error: float
    band: float
    """The baseline's seed-to-seed standard deviation of the window mean."""

    @property
    def beyond_noise(self) -> bool:
        return abs(self.mean_gap) - self.std_error > self.band

    @property
    def verdict(self) -> str:
        return "beyond noise" if self.beyond_noise else "within noise"


def window_steps(runs: dict[str, SeedCurves], last: int) -> list[int]:
    """The last ``last`` steps logged by every seed of every config, ascending."""
    shared = set.intersection(*(set(curve) for seeds in runs.values() for curve in seeds.values()))
    if not shared:
        raise ValueError("the runs share no logged step")
    return sorted(shared)[-last:]


def window_mean(curve: Curve, steps: list[int]) -> float:
    return sum(curve[s] for s in steps) / len(steps)


def noise_band(base: SeedCurves, steps: list[int]) -> float:
    """Sample standard deviation of the baseline's window means over its seeds."""
    if len(base) < 2:
        raise ValueError(f"the baseline has {len(base)} seed(s); the seed-to-seed spread needs at least 2")
    return statistics.stdev(window_mean(curve, steps) for curve in base.values())


def judge(runs: dict[str, SeedCurves], last: int) -> tuple[list[int], list[SeedVerdict]]:
    """The averaging window and, per config after the first (the baseline), its verdict against the band."""
    labels = list(runs)
    base = runs[labels[0]]
    steps = window_steps(runs, last)
    band = noise_band(base, steps)
    verdicts = []
    for label in labels[1:]:
        seeds = [s for s in base if s in runs[label]]
        if len(seeds) < 2:
            raise ValueError(f"{label} shares {len(seeds)} seed(s) with {labels[0]} ({sorted(runs[label])} vs "
                             f"{sorted(base)}); the standard error of its gap needs at least 2")
        gaps = {s: window_mean(runs[label][s], steps) - window_mean(base[s], steps) for s in seeds}
        std_error = statistics.stdev(gaps.values()) / math.sqrt(len(gaps))
        verdicts.append(SeedVerdict(label, seeds, gaps, statistics.fmean(gaps.values()), std_error, band))
    return steps, verdicts
