"""What the FP8 statistics say to a reader: the console summary of a stats step, the threshold warnings, and the
SQNR arithmetic they (and scripts/fp8_sqnr.py) share. The measuring is fp8_stats.py's."""
from __future__ import annotations

import math
from dataclasses import dataclass, field


@dataclass
class LayerHealth:
    """One Linear's numbers on one stats step, reduced over the data-parallel ranks."""

    fqn: str
    amax: dict[str, float] = field(default_factory=dict)
    """operand ('input', 'weight', 'grad_output') -> max |x|."""
    saturated: dict[str, float] = field(default_factory=dict)
    """cast name -> share of the operand's elements the cast clamps at the format's max."""
    underflow: dict[str, float] = field(default_factory=dict)
    """cast name -> share of the operand's elements that are nonzero and cast to 0."""
    output_sqnr_db: float | None = None
    casts: dict[str, str] = field(default_factory=dict)
    """cast name -> its format and scaling, e.g. 'e4m3 tensorwise'."""

    def scalars(self) -> dict[str, float]:
        """TensorBoard tags under ``fp8/<fqn>/`` -> value."""
        out = {f"{operand}_amax": value for operand, value in self.amax.items()}
        out |= {f"{name}_saturated": value for name, value in self.saturated.items()}
        out |= {f"{name}_underflow": value for name, value in self.underflow.items()}
        if self.output_sqnr_db is not None:
            out["output_sqnr_db"] = self.output_sqnr_db
        return {f"fp8/{self.fqn}/{key}": value for key, value in out.items()}


def summary_line(step: int, health: list[LayerHealth], *, worst: int = 3) -> str:
    """One line: the lowest output SQNRs and the largest underflow / saturation shares, worst layers only."""
    sqnr = sorted((h.output_sqnr_db, h.fqn) for h in health if h.output_sqnr_db is not None)
    parts = [f"fp8 stats step {step} ({len(health)} Linears)"]
    if sqnr:
        parts.append("lowest output SQNR " + ", ".join(f"{fqn} {_db(db)}" for db, fqn in sqnr[:worst]))
    for label, attr in (("underflow", "underflow"), ("saturated", "saturated")):
        shares = sorted(((share, f"{h.fqn} {name}") for h in health for name, share in getattr(h, attr).items()),
                        reverse=True)
        top = [(share, where) for share, where in shares[:worst] if share > 0]
        parts.append(f"{label} " + (", ".join(f"{where} {share:.2e}" for share, where in top) if top else "none"))
    return "; ".join(parts)


@dataclass(frozen=True)
class ThresholdCrossing:
    """A cast whose saturated or underflow share exceeds its threshold on one stats step."""

    key: tuple[str, str, str]
    """(layer fqn, cast name, 'saturated' | 'underflow'): what repeats from one stats step to the next."""
    share: float
    message: str


def threshold_crossings(step: int, health: list[LayerHealth], *, saturation: float,
                        underflow: float) -> list[ThresholdCrossing]:
    """Every layer and cast whose saturated / underflow share exceeds its threshold, with a message naming it."""
    crossings = []
    for h in health:
        for kind, label, shares, limit, why in (
            ("saturated", "saturates", h.saturated, saturation, "clamped at the format's max"),
            ("underflow", "flushes to zero", h.underflow, underflow,
             "nonzero but below the smallest subnormal after scaling"),
        ):
            for name, share in shares.items():
                if share > limit:
                    crossings.append(ThresholdCrossing((h.fqn, name, kind), share, (
                        f"fp8 stats step {step}: {h.fqn} {name} cast ({h.casts.get(name, '?')}) {label} "
                        f"{100 * share:.3g}% of its elements ({why}; threshold {100 * limit:.3g}%), amax "
                        f"{h.amax.get(_operand(name), math.nan):.3g}")))
    return crossings


def sqnr_db(signal_energy: float, noise_energy: float) -> float:
    """10*log10(signal / noise); +inf for an exact match, -inf for a zero reference with nonzero error."""
    if noise_energy == 0.0:
        return math.inf
    if signal_energy == 0.0:
        return -math.inf
    return 10.0 * math.log10(signal_energy / noise_energy)


def _operand(cast_name: str) -> str:
    return cast_name.removesuffix("_gw").removesuffix("_gi")


def _db(value: float) -> str:
    return f"{value:.1f} dB" if math.isfinite(value) else str(value)
