"""Model statistics under pipeline parallelism: every rank holds only its stages' layers, so what each part
read (e.g. one stage's MoE routers) is shared over the pipeline group before the model merges it into the
whole model's values; every rank then logs the same numbers for every layer.
"""
from __future__ import annotations

import torch
import torch.distributed as dist


def read_part_stats(stats: list[dict[str, torch.Tensor]]) -> list[dict[str, float]]:
    """Each part's device scalars as floats, read in one transfer."""
    flat = [value.detach().float().reshape(()) for part in stats for value in part.values()]
    read = iter(torch.stack(flat).tolist() if flat else [])
    return [{tag: next(read) for tag in part} for part in stats]


def gather_over_stages(values: list[dict[str, float]], group: dist.ProcessGroup | None) -> list[dict[str, float]]:
    """The read values of every part of every rank of the pipeline ``group`` (collective, on the host); ``values``
    unchanged without a pipeline."""
    if group is None:
        return values
    gathered: list[list[dict[str, float]] | None] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, values, group=group)
    return [part for rank_values in gathered for part in rank_values or []]
