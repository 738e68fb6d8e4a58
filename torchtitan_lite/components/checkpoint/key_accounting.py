"""Every rank's load checked against the checkpoint together: nothing this run holds is missing, nothing the
checkpoint holds is left unloaded.

Each rank asks DCP only for the keys it holds. Without pipeline parallelism that is the whole model on every
rank; under pipeline parallelism each rank holds its stages only, so no single rank can tell whether a block
of the checkpoint was loaded by some other stage or by none (a checkpoint of a deeper model would otherwise
lose its extra blocks without a word). The ranks therefore mark, over the checkpoint's sorted model keys and
the parameters its optimizer state names, which ones they load, and OR the marks together: every rank of
every pipeline takes part, and since each pipeline holds the same stages the union is one pipeline's.

A rank's own refusal (a key it holds that the checkpoint lacks, another shape) is shared in the same
collective, so a mismatch that only one stage sees stops every rank with the same message instead of leaving
the others waiting in DCP's load.
"""
from __future__ import annotations

from typing import Any

import torch.distributed as dist
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint.metadata import Metadata

from torchtitan_lite.components.checkpoint.verify import CheckpointError, check_compatible

_SHOWN = 5
_OPTIMIZER_SECTIONS = ("optimizer.state.", "optimizer.param_groups.")


def check_loadable(path: str, metadata: Metadata, target: dict[str, Any], *, rank: int, world_size: int) -> None:
    """Collective. Raise ``CheckpointError`` on every rank unless each rank's ``target`` matches the checkpoint
    (``check_compatible``) and the ranks together load every model key of the checkpoint and the optimizer
    state of every parameter it names (for the states in ``target``)."""
    flat, _ = flatten_state_dict(target)
    units = accounted_units(metadata, loading=set(target))
    held = set(flat) | {_optimizer_param(k) for k in flat if k.startswith(_OPTIMIZER_SECTIONS)}
    problem = None
    try:
        check_compatible(path, metadata, target)
    except CheckpointError as e:
        problem = str(e)
    # One bit per unit: a 405B model's ~2,300 units cost each rank 300 bytes in the gather.
    mask = sum(1 << i for i, (_, unit) in enumerate(units) if unit in held)
    gathered: list[Any] = [(problem, mask)]
    if dist.is_initialized() and world_size > 1:
        gathered = [None] * world_size
        dist.all_gather_object(gathered, (problem, mask))
    refusals = [(r, p) for r, (p, _) in enumerate(gathered) if p is not None]
    if refusals:
        first, text = refusals[0]
        ranks = f" (rank {first}{f' and {len(refusals) - 1} other(s)' if len(refusals) > 1 else ''})" \
            if world_size > 1 else ""
        raise CheckpointError(f"{text}{ranks}")
    loaded = 0
    for _, rank_mask in gathered:
        loaded |= rank_mask
    unloaded = [unit for i, unit in enumerate(units) if not loaded >> i & 1]
    if unloaded:
        raise CheckpointError(describe_unloaded(path, unloaded, world_size))


def accounted_units(metadata: Metadata, *, loading: set[str]) -> list[tuple[str, str]]:
    """(kind, name) of what must be loaded somewhere, sorted: every ``model.`` key of the checkpoint, and each
    parameter its optimizer state names (state keys per parameter may differ between optimizers; the
    parameters may not)."""
    units: set[tuple[str, str]] = set()
    for key in metadata.state_dict_metadata:
        if key.startswith("model.") and "model" in loading:
            units.add(("model key", key))
        elif key.startswith(_OPTIMIZER_SECTIONS) and "optimizer" in loading:
            units.add(("optimizer parameter", _optimizer_param(key)))
    return sorted(units, key=lambda u: u[1])


def describe_unloaded(path: str, unloaded: list[tuple[str, str]], world_size: int) -> str:
    counts = {kind: sum(k == kind for k, _ in unloaded) for kind in ("model key", "optimizer parameter")}
    what = " and ".join(f"{n} {kind}(s)" for kind, n in counts.items() if n)
    names = [name for _, name in unloaded]
    where = "this run" if world_size == 1 else f"any of this run's {world_size} ranks (pipeline stages included)"
    return (f"checkpoint {path} holds {what} that no part of the model of {where} loads, first {names[:_SHOWN]}. "
            f"It was written for a larger or different model (more blocks: another model.n_layers or flavor); "
            f"resume with the configuration that wrote it (its config.toml), or list the state in "
            f"checkpoint.exclude_from_loading to start it fresh")


def _optimizer_param(key: str) -> str:
    """``optimizer.state.<param fqn>.<state key>`` (or ``param_groups``) -> ``optimizer.<param fqn>``."""
    section = next(s for s in _OPTIMIZER_SECTIONS if key.startswith(s))
    return "optimizer." + key[len(section):].rsplit(".", 1)[0]
