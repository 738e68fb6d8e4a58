"""Which Linear layers run in FP8 (float8 or MXFP8), and why the others do not.

The plan is a pure function of module names and shapes, so it can be computed on the meta-device
model before conversion (``--print-fp8-plan``) and agrees with what the converter then does. Both
the float8 and the MX converter use it; each supplies its own shape rule.

A Linear stays in high precision when, checked in this order:

1. its FQN contains a ``filter_fqns`` entry (substring match, e.g. 'output' for the LM head);
1b. it sits in a module that the model keeps in high precision under every recipe (a class attribute
   ``high_precision_reason``, e.g. the MoE router's gate: see torchtitan_lite.protocols.grouped_experts);
2. it is the model's output projection and ``keep_output_hp`` is on (the default: the logits feed
   the softmax and the loss, where quantization error costs the most, and the layer is a small share
   of the FLOPs of a large model);
3. it sits in one of the first ``keep_first_blocks_hp`` or last ``keep_last_blocks_hp`` transformer
   blocks (the family's ``ParallelPlan.blocks`` container, in order), NeMo's high-precision edges: the first and last blocks see the
   least regular activations and gradients;
4. the converter's shape rule refuses it (``shape_skip_reason``). float8: ``in_features`` or
   ``out_features`` is not divisible by 16: ``torch._scaled_mm`` (the FP8 GEMM) requires both GEMM
   dims of its operands to be multiples of 16 (FP8 tensor-core tile alignment); MX: see mx.py;
5. float8 only: ``filter_fqns`` contains ``auto_filter_small_kn`` and the layer is below the size where
   the FP8 GEMM plus the casts beat BF16 for the recipe. Thresholds are torchao 0.18's
   ``torchao.float8.float8_linear_utils._auto_filter_for_tensorwise`` / ``_auto_filter_for_rowwise``
   (measured on H100), with K = in_features and N = out_features:

   - tensorwise: skipped when K <= 4096 and N <= 1024;
   - rowwise: skipped when N <= 2048, or K <= 1024, or (N <= 4096 and K <= 2048).
"""
from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol

import torch.nn as nn

from torchtitan_lite.protocols.grouped_experts import high_precision_reason

AUTO_FILTER_SMALL_KN = "auto_filter_small_kn"
ALIGNMENT = 16


@dataclass(frozen=True)
class PlanRow:
    fqn: str
    in_features: int
    out_features: int
    recipe: str | None
    """The FP8 recipe this Linear runs with, or None when it stays in high precision."""
    reason: str
    """Why the Linear is skipped; empty when it is converted."""

    @property
    def train_flops_per_token(self) -> int:
        """Matmul FLOPs per token for forward + backward: 2*in*out forward, twice that backward."""
        return 3 * 2 * self.in_features * self.out_features


def too_small(recipe_name: str, k: int, n: int) -> bool:
    """torchao's auto-filter size rule for the recipe (see the module docstring)."""
    if recipe_name == "tensorwise":
        return k <= 4096 and n <= 1024
    if recipe_name == "rowwise":
        return n <= 2048 or k <= 1024 or (n <= 4096 and k <= 2048)
    raise ValueError(f"{AUTO_FILTER_SMALL_KN} has no size rule for recipe {recipe_name!r}")


def skip_reason(fqn: str, in_features: int, out_features: int, *, recipe_name: str, filter_fqns: Iterable[str]) -> str:
    """Why this Linear stays out of the float8 recipe by name and shape, or '' when it is converted
    (the ``filter_fqns`` and float8 shape rules; the high-precision edges are the plan's)."""
    filters = list(filter_fqns)
    return filter_reason(fqn, filters) or float8_shape_reason(
        in_features, out_features, recipe_name=recipe_name, filter_fqns=filters)


def filter_reason(fqn: str, filter_fqns: Iterable[str]) -> str:
    """The ``filter_fqns`` entry that names ``fqn`` (substring match), or ''."""
    for entry in filter_fqns:
        if entry != AUTO_FILTER_SMALL_KN and entry in fqn:
            return f"filter_fqns entry {entry!r}"
    return ""


def float8_shape_reason(in_features: int, out_features: int, *, recipe_name: str, filter_fqns: Iterable[str]) -> str:
    """Why the float8 GEMM cannot (alignment) or should not (auto_filter_small_kn) take this shape, or ''."""
    if in_features % ALIGNMENT or out_features % ALIGNMENT:
        return f"dims not divisible by {ALIGNMENT}"
    if AUTO_FILTER_SMALL_KN in filter_fqns and too_small(recipe_name, in_features, out_features):
        return f"too small for {recipe_name} per {AUTO_FILTER_SMALL_KN} (K={in_features}, N={out_features})"
    return ""


class PlannedConverterConfig(Protocol):
    """What the plan reads of a converter config (float8 and MX alike)."""

    @property
    def recipe_name(self) -> str: ...
    @property
    def filter_fqns(self) -> list[str]: ...
    @property
    def keep_output_hp(self) -> bool: ...
    @property
    def keep_first_blocks_hp(self) -> int: ...
    @property
    def keep_last_blocks_hp(self) -> int: ...

    def shape_skip_reason(self, in_features: int, out_features: int) -> str: ...


def float8_plan(model: nn.Module, converter_config: PlannedConverterConfig, *, output_module: str,
                blocks: str) -> list[PlanRow]:
    """One row per ``nn.Linear`` of ``model`` (meta or real, before or after conversion).

    ``output_module`` is the FQN of the model's output projection (the family's ``ParallelPlan.output``),
    ``blocks`` the name of its block container (``ParallelPlan.blocks``).
    """
    edges = high_precision_edges(model, converter_config, output_module=output_module, blocks=blocks)
    # Modules the model keeps in high precision under every recipe (the MoE router gate).
    pinned = {fqn: reason for fqn, module in model.named_modules() if (reason := high_precision_reason(module))}
    rows = []
    for fqn, module in model.named_modules():
        if not isinstance(module, nn.Linear):
            continue
        reason = (filter_reason(fqn, converter_config.filter_fqns) or _edge_reason(fqn, pinned)
                  or _edge_reason(fqn, edges)
                  or converter_config.shape_skip_reason(module.in_features, module.out_features))
        recipe = None if reason else converter_config.recipe_name
        rows.append(PlanRow(fqn, module.in_features, module.out_features, recipe, reason))
    return rows


def high_precision_edges(model: nn.Module, config: PlannedConverterConfig, *, output_module: str,
                         blocks: str) -> dict[str, str]:
    """Module FQN -> why everything under it stays in high precision: the output projection
    (``keep_output_hp``) and the first / last blocks (``keep_first_blocks_hp`` / ``keep_last_blocks_hp``)."""
    edges: dict[str, str] = {}
    if config.keep_output_hp:
        edges[output_module] = "output projection (keep_output_hp)"
    first, last = config.keep_first_blocks_hp, config.keep_last_blocks_hp
    if not first and not last:
        return edges
    container = getattr(model, blocks, None)
    if not isinstance(container, (nn.ModuleDict, nn.ModuleList)):
        raise ValueError(f"keep_first_blocks_hp={first} / keep_last_blocks_hp={last} need the model's transformer "
                         f"blocks in model.{blocks}, and {type(model).__name__} has none; set both to 0")
    names = (list(container.keys()) if isinstance(container, nn.ModuleDict)
             else [str(i) for i in range(len(container))])
    if first + last >= len(names):
        raise ValueError(f"keep_first_blocks_hp={first} + keep_last_blocks_hp={last} keep all {len(names)} blocks "
                         f"in high precision, so no block Linear would be converted; lower them (at most "
                         f"{len(names) - 1} together) or remove the converter")
    for i, name in enumerate(names):
        if i < first:
            edges[f"{blocks}.{name}"] = f"block {i} of the first {first} (keep_first_blocks_hp)"
        elif i >= len(names) - last:
            edges[f"{blocks}.{name}"] = f"block {i} of the last {last} (keep_last_blocks_hp)"
    return edges


def check_edge_fields(config: PlannedConverterConfig, field: str) -> None:
    """The high-precision edge fields of a converter config are non-negative integers (``field`` names the
    converter entry in errors)."""
    for name in ("keep_first_blocks_hp", "keep_last_blocks_hp"):
        value = getattr(config, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"{field}.{name}={value!r} must be a non-negative integer (the number of blocks kept "
                             f"in high precision); use 0 to convert every block")


def check_filter_fqns(config: PlannedConverterConfig, field: str) -> None:
    """Every ``filter_fqns`` entry of a converter config is a non-empty string (``field`` names the converter
    entry in errors): an empty one would match, and keep in high precision, every module."""
    for entry in config.filter_fqns:
        if not isinstance(entry, str) or not entry:
            raise ValueError(f"{field}.filter_fqns entry {entry!r} would match every module; "
                             f"use non-empty FQN substrings such as 'output'")


def _edge_reason(fqn: str, edges: dict[str, str]) -> str:
    for prefix, reason in edges.items():
        if fqn == prefix or fqn.startswith(prefix + "."):
            return reason
    return ""


def fp8_flops_share(rows: list[PlanRow], *, total_flops_per_token: float | None = None,
                    expert_fp8_flops_per_token: float = 0.0) -> float:
    """Fraction of training FLOPs per token that run in FP8.

    Relative to ``total_flops_per_token`` (the model's total forward+backward FLOPs per token,
    attention included) when given, else relative to the FLOPs of all Linear layers.
    ``expert_fp8_flops_per_token``: the routed experts' grouped GEMMs that run in FP8 (the moe_experts
    converter's, per token over the top_k experts it visits); they are in the model's total but no Linear.
    """
    fp8 = sum(r.train_flops_per_token for r in rows if r.recipe is not None) + expert_fp8_flops_per_token
    total = total_flops_per_token if total_flops_per_token else sum(r.train_flops_per_token for r in rows)
    return fp8 / total if total else 0.0


def format_float8_plan(rows: list[PlanRow], *, seq_len: int | None = None,
                       total_flops_per_token: float | None = None, expert_fp8_flops_per_token: float = 0.0) -> str:
    """A table of every Linear with its FP8 recipe or skip reason, and the FP8 share of FLOPs."""
    converted = sum(r.recipe is not None for r in rows)
    header = ("fqn", "in", "out", "fp8 recipe", "skipped because")
    body = [(r.fqn or "<root>", str(r.in_features), str(r.out_features), r.recipe or "-", r.reason) for r in rows]
    widths = [max(len(line[i]) for line in [header, *body]) for i in range(len(header))]

    def fmt(line: tuple[str, ...]) -> str:
        return "  ".join(cell.rjust(w) if i in (1, 2) else cell.ljust(w) for i, (cell, w) in enumerate(zip(line, widths))).rstrip()

    lines = [f"FP8 plan: {converted} of {len(rows)} Linear layers run in FP8", fmt(header)]
    lines += [fmt(line) for line in body]
    lines.append(_share_line(rows, seq_len=seq_len, total_flops_per_token=total_flops_per_token,
                             expert_fp8_flops_per_token=expert_fp8_flops_per_token))
    return "\n".join(lines)


def format_plan_summary(rows: list[PlanRow], *, seq_len: int | None = None,
                        total_flops_per_token: float | None = None, expert_fp8_flops_per_token: float = 0.0) -> str:
    """The plan in four lines, for the launch log: Linears per recipe, the others per skip reason, the
    high-precision edges and the FP8 share (the table of every Linear is --print-fp8-plan's, hundreds of
    lines for a large model)."""
    recipes = Counter(r.recipe for r in rows if r.recipe is not None)
    reasons = Counter(_reason_kind(r.reason) for r in rows if r.recipe is None)
    converted = sum(recipes.values())
    per_recipe = ", ".join(f"{n} {recipe}" for recipe, n in recipes.most_common())
    kept = "; ".join(f"{n} {reason}" for reason, n in reasons.most_common())
    edges = list(dict.fromkeys(_edge_module(r) for r in rows if r.recipe is None and _is_edge(r.reason)))
    lines = [f"FP8 plan: {converted} of {len(rows)} Linear layers run in FP8" + (f" ({per_recipe})" if per_recipe else "")
             + (f"; high precision: {kept}" if kept else ""),
             f"high-precision edges: {', '.join(edges) if edges else 'none'}",
             _share_line(rows, seq_len=seq_len, total_flops_per_token=total_flops_per_token,
                         expert_fp8_flops_per_token=expert_fp8_flops_per_token),
             "every Linear with its recipe or skip reason: --print-fp8-plan"]
    return "\n".join(lines)


_EDGE_FIELDS = ("keep_output_hp", "keep_first_blocks_hp", "keep_last_blocks_hp")


def _reason_kind(reason: str) -> str:
    """A skip reason without what differs per layer (its K / N, which block), so that layers group by it."""
    reason = re.sub(r" \(K=\d+, N=\d+\)$", "", reason)
    return re.sub(r"^block \d+ of the (first|last) (\d+) ", r"in the \1 \2 block(s) ", reason)


def _is_edge(reason: str) -> bool:
    return any(f"({field})" in reason for field in _EDGE_FIELDS)


def _edge_module(row: PlanRow) -> str:
    """The module a high-precision edge keeps: the output projection itself, or its block (<blocks>.<i>)."""
    return row.fqn if "(keep_output_hp)" in row.reason else ".".join(row.fqn.split(".")[:2])


def _share_line(rows: list[PlanRow], *, seq_len: int | None, total_flops_per_token: float | None,
                expert_fp8_flops_per_token: float = 0.0) -> str:
    share = fp8_flops_share(rows, total_flops_per_token=total_flops_per_token,
                            expert_fp8_flops_per_token=expert_fp8_flops_per_token)
    if total_flops_per_token:
        at = f" at seq_len {seq_len}" if seq_len is not None else ""
        basis = f"of the model's training FLOPs per token{at} (attention included)"
    else:
        basis = "of all Linear matmul FLOPs (attention and other ops not counted)"
    counted = "Linear FLOPs counted as 6*in*out per token (fwd+bwd)"
    if expert_fp8_flops_per_token:
        linears = sum(r.train_flops_per_token for r in rows if r.recipe is not None)
        total = total_flops_per_token or sum(r.train_flops_per_token for r in rows)
        counted = (f"FP8 Linears {100 * linears / total:.1f}% + FP8 routed experts "
                   f"{100 * expert_fp8_flops_per_token / total:.1f}% (6*in*out x top_k per token); " + counted)
    return f"FP8 share: {100 * share:.1f}% {basis}; {counted}"
