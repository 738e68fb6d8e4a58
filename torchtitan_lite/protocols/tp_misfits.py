"""Modules whose tensor-parallel shards a converter's recipe cannot take, gathered into one refusal.

A recipe with blocks (blockwise FP8's 1x128 tiles and 128x128 weight blocks) cannot run on a TP shard that cuts
its blocks. Every converter reports all such modules of the model (``ModelConverter.tp_misfits``) and the container
refuses the run once, naming them all and the two ways out: a ``parallelism.tp`` that fits every one of them, or
``filter_fqns`` entries that keep exactly those modules, and no module that fits, in high precision.
"""
from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class TpMisfit:
    """One module a TP shard would cut."""

    fqn: str
    detail: str
    """Its shape and the split, e.g. '128 -> 256, row-wise: in_features 128 / 2 = 64'."""
    tp_degrees: tuple[int, ...]
    """The tensor-parallel degrees whose shards it can take."""


@dataclass(frozen=True)
class TpMisfits:
    """A converter's modules that ``parallelism.tp`` would cut, and the filter that keeps only them out."""

    field: str
    """The converter entry, e.g. 'model_converters.converters[float8_blockwise]'."""
    rule: str
    """What each shard must hold, e.g. 'whole 1x128 tiles and 128x128 weight blocks'."""
    misfits: tuple[TpMisfit, ...]
    filter_entries: tuple[str, ...]
    """``filter_fqns`` entries matching every misfit and no module the converter would otherwise convert."""
    filter_fqns: tuple[str, ...]
    """The converter's own ``filter_fqns`` (a command-line list replaces them, so the suggestion repeats them)."""


def exact_filter_entries(misfits: Sequence[str], others: Iterable[str]) -> tuple[str, ...]:
    """Substring ``filter_fqns`` entries that together match every FQN of ``misfits`` and none of ``others``.

    For each misfit not yet matched, the shortest trailing run of at least two FQN components that no other
    contains ('attention.wo' when every block's wo misfits; 'layers.1.attention.wo' when only block 1's does),
    else the whole FQN. Two components at least: a bare name ('w1') reads as every module of that name."""
    others = list(others)
    entries: list[str] = []
    for fqn in misfits:
        if any(entry in fqn for entry in entries):
            continue
        parts = fqn.split(".")
        for k in range(min(2, len(parts)), len(parts) + 1):
            candidate = ".".join(parts[-k:])
            if parts[-k].isdigit():  # '1.attention.wo' would read as a block index cut short (and match block 11)
                continue
            if not any(candidate in other for other in others):
                entries.append(candidate)
                break
        else:
            entries.append(fqn)
    return tuple(entries)


def _grouped(misfits: Sequence[TpMisfit]) -> list[str]:
    """'layers.{1,2,3}.moe.shared_experts.w1 (detail)': one entry per module of the blocks with the same detail."""
    groups: dict[tuple[str, str], list[str]] = {}
    for misfit in misfits:
        match = re.match(r"^(\w+)\.(\d+)\.(.+)$", misfit.fqn)
        key = (f"{match[1]}.{{}}.{match[3]}" if match else misfit.fqn, misfit.detail)
        groups.setdefault(key, []).append(match[2] if match else "")
    out = []
    for (name, detail), layers in groups.items():
        if "{}" in name:
            name = name.replace("{}", layers[0] if len(layers) == 1 else "{" + ",".join(layers) + "}")
        out.append(f"{name} ({detail})")
    return out


def tp_misfits_message(reports: Sequence[tuple[int | None, TpMisfits]], *, tp: int) -> str:
    """One refusal naming every misfit of every converter (``(index in model_converters.converters, report)``;
    index None when a converter refuses on its own), the degrees that fit all of them, and the exact filters."""
    reports = [(i, r) for i, r in reports if r.misfits]
    count = sum(len(r.misfits) for _, r in reports)
    parts = [f"{r.field}: {'; '.join(_grouped(r.misfits))}" for _, r in reports]
    rules = sorted({r.rule for _, r in reports})
    text = (f"parallelism.tp={tp} would cut {count} module(s) whose shards must hold {' / '.join(rules)}: "
            f"{' | '.join(parts)}. ")
    degrees = sorted(set.intersection(*(set(m.tp_degrees) for _, r in reports for m in r.misfits)))
    fixes = [f"use parallelism.tp in {degrees}"] if degrees else []
    if all(i is not None for i, _ in reports):
        flags = " ".join(f"--model_converters.converters.{i}.filter_fqns {','.join(r.filter_fqns + r.filter_entries)}"
                         for i, r in reports)
        fixes.append(f"keep exactly these in high precision with {flags}")
    else:
        fixes.append("keep exactly these in high precision: add " + " and ".join(
            f"{', '.join(repr(e) for e in r.filter_entries)} to {r.field}.filter_fqns" for _, r in reports))
    return text + "Fix: " + ", or ".join(fixes)
