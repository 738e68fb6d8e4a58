"""Is a recipe's validation loss within δ of its baseline's, and could this comparison have seen otherwise?

Each arm trains once per seed; one seed gives every arm the same initial weights and the same batches, so
the per-seed gap ``recipe[s] - baseline[s]`` cancels what the seed does to both (the seed-to-seed spread of
one arm's loss is 10-50x the spread of the gaps). The statistic of one run is the mean of its validation
losses at the last evaluation points (the same held-out windows for every arm). Over K seeds:

- ``upper = mean(gaps) + t(0.95, K-1) * SE`` and ``lower = mean(gaps) - t(0.95, K-1) * SE``, with
  ``SE = stdev(gaps) / sqrt(K)``: a one-sided 95% bound either way;
- **PASS** when ``upper <= δ`` (the recipe costs at most δ, at 95% confidence), **FAIL** when ``lower > δ``
  (it costs more than δ), **UNDECIDED** otherwise (more seeds narrow the interval).

A verdict counts only when its two controls behave in the same run: the baseline's own precision step
(BF16 against FP32) must PASS, which says δ is not tighter than a known-good format, and a planted fault must
FAIL, which says this comparison could see a bug; otherwise every recipe is INCONCLUSIVE.
"""
from __future__ import annotations

import functools
import math
import statistics
from collections.abc import Mapping
from dataclasses import dataclass

PASS, FAIL, UNDECIDED, INCONCLUSIVE = "PASS", "FAIL", "UNDECIDED", "INCONCLUSIVE"
CONFIDENCE = 0.95


@functools.cache
def t_quantile(p: float, df: int) -> float:
    """The ``p`` quantile of Student's t with ``df`` degrees of freedom (p in (0.5, 1)): bisection on the CDF,
    the CDF by Simpson's rule on the density (error < 1e-9 for df >= 1 at the quantiles used here)."""
    if df < 1:
        raise ValueError(f"Student's t needs at least 1 degree of freedom, got {df}")
    if not 0.5 < p < 1.0:
        raise ValueError(f"quantile level must lie in (0.5, 1), got {p}")
    log_norm = math.lgamma((df + 1) / 2) - math.lgamma(df / 2) - 0.5 * math.log(df * math.pi)

    def density(x: float) -> float:
        return math.exp(log_norm - (df + 1) / 2 * math.log1p(x * x / df))

    def cdf_above_half(x: float) -> float:
        # 0.5 + the integral of the density over [0, x]: substitute x = tan(theta) so the heavy tail of df = 1
        # (Cauchy) becomes a finite, smooth integrand on [0, atan(x)].
        top, n = math.atan(x), 2000
        h = top / n
        total = 0.0
        for i in range(n + 1):
            theta = i * h
            weight = 1 if i in (0, n) else (4 if i % 2 else 2)
            total += weight * density(math.tan(theta)) / math.cos(theta) ** 2
        return 0.5 + total * h / 3

    low, high = 0.0, 1.0
    while cdf_above_half(high) < p:
        high *= 2
    for _ in range(60):
        mid = (low + high) / 2
        low, high = (mid, high) if cdf_above_half(mid) < p else (low, mid)
    return (low + high) / 2


@dataclass(frozen=True)
class PairedVerdict:
    label: str
    """``recipe vs baseline``."""
    gaps: dict[str, float]
    """seed -> recipe's statistic minus the baseline's, that seed."""
    delta: float

    @property
    def mean(self) -> float:
        return statistics.fmean(self.gaps.values())

    @property
    def std_error(self) -> float:
        return statistics.stdev(self.gaps.values()) / math.sqrt(len(self.gaps))

    @property
    def half_width(self) -> float:
        return t_quantile(CONFIDENCE, len(self.gaps) - 1) * self.std_error

    @property
    def upper(self) -> float:
        return self.mean + self.half_width

    @property
    def lower(self) -> float:
        return self.mean - self.half_width

    @property
    def outcome(self) -> str:
        if self.upper <= self.delta:
            return PASS
        if self.lower > self.delta:
            return FAIL
        return UNDECIDED


def paired(label: str, recipe: Mapping[str, float], baseline: Mapping[str, float], delta: float) -> PairedVerdict:
    """The verdict on ``recipe`` against ``baseline`` (seed -> statistic each) over the seeds both ran."""
    seeds = [s for s in baseline if s in recipe]
    if len(seeds) < 2:
        raise ValueError(f"{label}: a paired verdict needs at least 2 seeds both arms ran, got {seeds or 'none'}")
    return PairedVerdict(label, {s: recipe[s] - baseline[s] for s in seeds}, delta)


@dataclass(frozen=True)
class Verdicts:
    control: PairedVerdict
    """The baseline against the reference precision (BF16 vs FP32): must PASS."""
    fault: PairedVerdict
    """A planted-fault arm against the baseline: must FAIL."""
    recipes: list[PairedVerdict]

    @property
    def controls_behave(self) -> bool:
        return self.control.outcome == PASS and self.fault.outcome == FAIL

    def final(self, verdict: PairedVerdict) -> str:
        """A recipe's verdict as reported: its own outcome when the controls behave, else INCONCLUSIVE (an
        UNDECIDED interval is inconclusive too: more seeds would decide it)."""
        if not self.controls_behave or verdict.outcome == UNDECIDED:
            return INCONCLUSIVE
        return verdict.outcome

    def why_inconclusive(self) -> list[str]:
        reasons = []
        if self.control.outcome != PASS:
            reasons.append(f"the control {self.control.label} reads {self.control.outcome}, not PASS: δ "
                           f"{self.control.delta:g} is tighter than a known-good precision step")
        if self.fault.outcome != FAIL:
            reasons.append(f"the planted fault {self.fault.label} reads {self.fault.outcome}, not FAIL: this "
                           f"comparison cannot see a bug of that size")
        return reasons


def statistic(losses: Mapping[int, float], eval_steps: tuple[int, ...], where: str) -> float:
    """The mean validation loss of one run over ``eval_steps``; ValueError naming the missing steps."""
    missing = [s for s in eval_steps if s not in losses]
    if missing:
        raise ValueError(f"{where} has no validation loss at step(s) {missing} (it has {sorted(losses)}); "
                         f"the run stopped early or validation.freq does not divide them")
    return statistics.fmean(losses[s] for s in eval_steps)
