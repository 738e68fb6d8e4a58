"""Forwards that only measure shapes: torch's pipeline schedules run every stage once on placeholder tensors
(uninitialised, or the first micro-batch detached) to learn what the stages pass each other, at the first step
and after each switch between training and evaluation. The pipeline runner marks that pass; a model keeps
nothing of it that a real forward would keep for later (e.g. the expert-parallel exchanges kept for an
activation-checkpointing recomputation). Buffers the pass changes are restored by the runner itself.
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator

_depth = 0


@contextlib.contextmanager
def placeholder_forward() -> Iterator[None]:
    global _depth
    _depth += 1
    try:
        yield
    finally:
        _depth -= 1


def in_placeholder_forward() -> bool:
    """True inside ``placeholder_forward()`` (eager code only: a compiled graph would bake the value in)."""
    return _depth > 0
