"""Checks of the model arguments every family has, with the messages that name the fix."""
from __future__ import annotations

from collections.abc import Iterable


def check_positive_ints(args: object, names: Iterable[str]) -> None:
    """ValueError for the first of `names` whose value on `args` is not a positive integer."""
    for name in names:
        value = getattr(args, name)
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"model args: {name}={value!r} must be a positive integer")


def check_head_groups(n_heads: int, n_kv_heads: int) -> None:
    """Grouped-query attention needs each key/value head to serve a whole group of query heads."""
    if n_heads % n_kv_heads != 0:
        raise ValueError(
            f"model args: n_heads={n_heads} must be a multiple of n_kv_heads={n_kv_heads} "
            "(each key/value head serves a whole group of query heads)"
        )


def check_positive(args: object, names: Iterable[str]) -> None:
    """ValueError for the first of `names` whose value on `args` is not positive (norm_eps, rope_theta, ...)."""
    for name in names:
        value = getattr(args, name)
        if value <= 0:
            raise ValueError(f"model args: {name}={value} must be positive")
