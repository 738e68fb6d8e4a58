"""Loading saved states from one checkpoint folder into the run's stateful objects.

Model and optimizer state are sharded tensors that DCP reshards on load (save on FSDP 2, load on
1 process or FSDP x TP). Per-rank state that is not a sharded tensor (``dataloader``,
``train_state`` with its RNGs) is stored under rank-unique keys ``<name>.rank<r>``. A state with
``load_rank_states`` (the data loader) takes every saved rank's copy: when the data-parallel degree or the
world size changed since the save, every rank reads all of them and the loader continues from them (a
window position is the same on every rank; a stream's refuses another degree).
"""
from __future__ import annotations

import logging
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.stateful import Stateful

from torchtitan_lite.components.checkpoint.key_accounting import check_loadable
from torchtitan_lite.components.checkpoint.stateful import PER_RANK_STATES, decode
from torchtitan_lite.components.checkpoint.verify import (
    CheckpointError,
    WeightsOnlyLoadPlanner,
    describe_failure,
    saved_state_names,
    saved_tensor_shape,
)
from torchtitan_lite.components.data.layout import DataLayout

# Under the checkpoint manager's name: the checkpoint lines of a run carry one name, whichever module writes them.
logger = logging.getLogger("torchtitan_lite.components.checkpoint.manager")


def load_states(path: str, metadata: Metadata, names: list[str], saved_world_size: int | None,
                saved_layout: DataLayout | None, *, states: dict[str, Stateful], rank: int, world_size: int,
                data_layout: DataLayout | None) -> dict[str, Any]:
    """DCP-load ``names`` of ``states`` from ``path`` after checking the folder; returns decoded per-rank
    states. ``data_layout`` is this run's, ``saved_layout`` the checkpoint's."""
    target: dict[str, Any] = {}
    per_rank_keys: dict[str, list[str]] = {}
    for name in names:
        if name not in PER_RANK_STATES:
            target[name] = without_absent_optional_keys(name, states[name], metadata)
            continue
        keys = per_rank_sources(path, metadata, name, saved_world_size, saved_layout, state=states[name], rank=rank,
                                world_size=world_size, data_layout=data_layout)
        if not keys:
            continue
        target[name] = {}
        for key in keys:
            shape = saved_tensor_shape(metadata, f"{name}.{key}")
            if shape is None:
                raise CheckpointError(f"checkpoint {path} has no {name!r} state for {key} (it holds "
                                      f"{sorted(saved_state_names(metadata))})")
            target[name][key] = torch.empty(shape, dtype=torch.uint8)
        per_rank_keys[name] = keys
    check_loadable(path, metadata, target, rank=rank, world_size=world_size)
    try:
        dcp.load(target, checkpoint_id=path, planner=WeightsOnlyLoadPlanner(), no_dist=not dist.is_initialized())
    except CheckpointException as e:
        raise CheckpointError(f"loading checkpoint {path} failed: {describe_failure(e)}") from e
    restored = {}
    for name, value in target.items():
        if name in per_rank_keys and hasattr(states[name], "load_rank_states"):
            states[name].load_rank_states([decode(value[key]) for key in per_rank_keys[name]])  # type: ignore[attr-defined]
        elif name in per_rank_keys:
            restored[name] = decode(value[per_rank_keys[name][0]])
            states[name].load_state_dict(restored[name])
        else:
            states[name].load_state_dict(value)
    return restored


def per_rank_sources(path: str, metadata: Metadata, name: str, saved_world_size: int | None,
                     saved_layout: DataLayout | None, *, state: Stateful, rank: int, world_size: int,
                     data_layout: DataLayout | None) -> list[str]:
    """The saved copies of per-rank state ``name`` (``state``) this rank reads."""
    own = f"rank{rank}"
    same_world = saved_world_size == world_size
    if hasattr(state, "load_rank_states"):
        same_dp = saved_layout is None or data_layout is None or \
            saved_layout.dp_degree == data_layout.dp_degree
        if same_world and same_dp:
            return [own]
        saved_ranks = saved_world_size if saved_world_size is not None else count_rank_keys(metadata)
        if saved_ranks is None:
            logger.warning("%s does not say how many ranks saved it: %s starts from the beginning", path, name)
            return []
        return [f"rank{r}" for r in range(saved_ranks)]
    if same_world:
        return [own]
    # The step is the same on every rank; RNG streams come from rank 0 where this rank has none.
    return [own if saved_tensor_shape(metadata, f"{name}.{own}") is not None else "rank0"]


def count_rank_keys(metadata: Metadata) -> int | None:
    """How many ranks saved a checkpoint without a marker to say so, from its per-rank train_state keys."""
    ranks = [k for k in metadata.state_dict_metadata if k.startswith("train_state.rank")]
    return len(ranks) or None


def without_absent_optional_keys(name: str, state: Any, metadata: Metadata) -> dict[str, Any]:
    """``state``'s state_dict without the keys it declares optional (``OPTIONAL_STATE_KEYS``: added after
    earlier releases wrote their checkpoints) that the checkpoint lacks, so such a checkpoint still resumes."""
    state_dict = state.state_dict()
    saved = metadata.state_dict_metadata
    for key in getattr(state, "OPTIONAL_STATE_KEYS", ()):
        if key in state_dict and f"{name}.{key}" not in saved:
            logger.info("checkpoint has no %s.%s (written by an earlier release): it starts fresh", name, key)
            del state_dict[key]
    return state_dict
