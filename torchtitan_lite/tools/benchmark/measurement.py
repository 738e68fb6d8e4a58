"""What one measured run hands back: the JSON contract between the benchmark's worker processes
(``scripts/_bench_worker.py``, ``scripts/bare_loop.py --json-out``) and the runner that reports them.

Only raw wall-clock times and the sizes needed to turn them into rates are recorded; every derived
number is computed in ``report``, so the arithmetic is testable on fake measurements.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Measurement:
    """Raw numbers from one run of one config (also the JSON a worker writes)."""

    config: str
    """Registry name of the config."""
    device_type: str
    """'cpu' or 'cuda'."""
    device_name: str
    """CPU model (with thread count) or GPU name."""
    dp_degree: int
    """Data-parallel ranks: each processes its own tokens."""
    tp_degree: int
    """Tensor-parallel ranks: they process the same tokens together."""
    tokens_per_step: int
    """Input tokens one data-parallel rank processes per optimizer step (micro-batches x batch x seq len)."""
    flops_per_token: float
    """Training FLOPs (forward + backward) per token of the whole model."""
    peak_flops: float | None
    """Per-device peak FLOP/s that MFU is measured against; None when unknown."""
    compile_enabled: bool
    """Whether torch.compile was on (then the first step includes compilation)."""
    first_step_s: float
    """Duration of train_step for step 1."""
    step_s: list[float]
    """Wall time of each timed step: from the end of the previous train_step to the end of this one,
    so it covers the whole loop iteration (data, train_step, metrics, checkpoint checks, gc)."""
    train_step_s: list[float]
    """Duration of train_step alone for each timed step."""
    peak_memory_gib: float
    """CUDA: max allocated over all steps; CPU: peak resident set size of the process."""
    peak_reserved_gib: float | None = None
    """CUDA: max reserved by the caching allocator; None on CPU."""

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Measurement:
        return cls(**data)


@dataclass(frozen=True)
class BareMeasurement:
    """The hand-written loop's result for one config (JSON written by scripts/bare_loop.py)."""

    config: str
    tokens_per_s: float
    """Input tokens per second over the timed steps."""
    steps: int
    """Timed steps."""
    elapsed_s: float
    """Wall time of the timed steps."""
    trainer_tokens_per_s: float | None = None
    """The trainer's step (data + train_step) in the same process, alternated step by step with the
    bare one so that both see the same machine load; None when it was not run."""

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> BareMeasurement:
        return cls(**data)
