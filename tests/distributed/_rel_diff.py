"""The comparison every multi-rank test makes of per-step series (losses, gradient norms) against a reference."""
from __future__ import annotations


def rel_diff(values, reference) -> float:
    """The largest |value - reference| / |reference| over two series of the same length."""
    return max(abs(a - b) / abs(b) for a, b in zip(values, reference, strict=True))
