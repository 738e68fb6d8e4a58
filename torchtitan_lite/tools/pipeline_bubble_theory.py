"""The analytic side of the pipeline bubble: a rank's idle share from its timings, each schedule's idle share by
its published formula (pipeline_bubble.py's docstring states the formulas and their sources), and the equal
split of the blocks into stages that the formulas assume."""
from __future__ import annotations

from torchtitan_lite.distributed.pipeline import SCHEDULES


def idle_share(step_s: float, compute_s: float) -> float:
    """Share of the step a rank spent outside compute."""
    if step_s <= 0:
        raise ValueError(f"step time must be positive, got {step_s}")
    return 1.0 - compute_s / step_s


def theory_idle_share(schedule: str, *, pp: int, n_microbatches: int, stages_per_rank: int,
                      chunk_s: dict[str, float] | None = None) -> float | None:
    """The schedule's idle share of a step by its published formula (pipeline_bubble.py's docstring); None for
    DualPipeV without the chunk times (``chunk_s``: mean seconds of 'forward', 'backward_input',
    'backward_weight')."""
    p, m = pp, n_microbatches
    if schedule == "1F1B":
        return (p - 1) / (m + p - 1)
    if schedule == "Interleaved1F1B":
        return (p - 1) / (stages_per_rank * m + p - 1)
    if schedule == "ZBVZeroBubble":
        return 0.0
    if schedule == "DualPipeV":
        if chunk_s is None:
            return None
        f, w = chunk_s["forward"], chunk_s["backward_weight"]
        full_backward = chunk_s["backward_input"] + w
        bubble = max(0.0, (p - 1) * ((f + full_backward) + full_backward - 3 * w))
        compute = m * stages_per_rank * (f + full_backward)
        return bubble / (bubble + compute)
    raise ValueError(f"unknown schedule {schedule!r}; one of {', '.join(SCHEDULES)}")


def equal_split_points(n_layers: int, n_stages: int, blocks: str) -> list[str]:
    """Split points giving every stage the same number of blocks (refuses when they do not divide); ``blocks``
    names the model's block container (its family's ParallelPlan.blocks)."""
    if n_layers % n_stages != 0:
        raise ValueError(f"{n_layers} blocks do not split into {n_stages} equal stages: use --n-layers a multiple "
                         f"of {n_stages}")
    per = n_layers // n_stages
    return [f"{blocks}.{i * per}" for i in range(1, n_stages)]
