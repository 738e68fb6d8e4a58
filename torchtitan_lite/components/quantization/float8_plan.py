"""Which Linear layers run in FP8, and why the others do not.

The plan is a pure function of module names and shapes, so it can be computed on the meta-device
model before conversion (``--print-fp8-plan``) and agrees with what the converter then does.

A Linear stays in high precision when, checked in this order:

1. its FQN contains a ``filter_fqns`` entry (substring match, e.g. 'output' for the LM head);
2. ``in_features`` or ``out_features`` is not divisible by 16: ``torch._scaled_mm`` (the FP8 GEMM)
   requires both GEMM dims of its operands to be multiples of 16 (FP8 tensor-core tile alignment);
3. ``filter_fqns`` contains ``auto_filter_small_kn`` and the layer is below the size where the FP8
   GEMM plus the casts beat BF16 for the recipe. Thresholds are torchao 0.18's
   ``torchao.float8.float8_linear_utils._auto_filter_for_tensorwise`` / ``_auto_filter_for_rowwise``
   (measured on H100), with K = in_features and N = out_features:

   - tensorwise: skipped when K <= 4096 and N <= 1024;
   - rowwise: skipped when N <= 2048, or K <= 1024, or (N <= 4096 and K <= 2048).
"""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch.nn as nn

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
    """Why this Linear stays in high precision, or '' when it is converted to FP8."""
    filters = list(filter_fqns)
    for entry in filters:
        if entry != AUTO_FILTER_SMALL_KN and entry in fqn:
            return f"filter_fqns entry {entry!r}"
    if in_features % ALIGNMENT or out_features % ALIGNMENT:
        return f"dims not divisible by {ALIGNMENT}"
    if AUTO_FILTER_SMALL_KN in filters and too_small(recipe_name, in_features, out_features):
        return f"too small for {recipe_name} per {AUTO_FILTER_SMALL_KN} (K={in_features}, N={out_features})"
    return ""


def float8_plan(model: nn.Module, converter_config: Any) -> list[PlanRow]:
    """One row per ``nn.Linear`` of ``model`` (meta or real, before or after conversion)."""
    rows = []
    for fqn, module in model.named_modules():
        if not isinstance(module, nn.Linear):
            continue
        reason = skip_reason(fqn, module.in_features, module.out_features,
                             recipe_name=converter_config.recipe_name, filter_fqns=converter_config.filter_fqns)
        recipe = None if reason else converter_config.recipe_name
        rows.append(PlanRow(fqn, module.in_features, module.out_features, recipe, reason))
    return rows


def fp8_flops_share(rows: list[PlanRow], *, total_flops_per_token: float | None = None) -> float:
    """Fraction of training FLOPs per token that run in FP8.

    Relative to ``total_flops_per_token`` (the model's total forward+backward FLOPs per token,
    attention included) when given, else relative to the FLOPs of all Linear layers.
    """
    fp8 = sum(r.train_flops_per_token for r in rows if r.recipe is not None)
    total = total_flops_per_token if total_flops_per_token else sum(r.train_flops_per_token for r in rows)
    return fp8 / total if total else 0.0


def format_float8_plan(rows: list[PlanRow], *, seq_len: int | None = None,
                       total_flops_per_token: float | None = None) -> str:
    """A table of every Linear with its FP8 recipe or skip reason, and the FP8 share of FLOPs."""
    converted = sum(r.recipe is not None for r in rows)
    header = ("fqn", "in", "out", "fp8 recipe", "skipped because")
    body = [(r.fqn or "<root>", str(r.in_features), str(r.out_features), r.recipe or "-", r.reason) for r in rows]
    widths = [max(len(line[i]) for line in [header, *body]) for i in range(len(header))]

    def fmt(line: tuple[str, ...]) -> str:
        return "  ".join(cell.rjust(w) if i in (1, 2) else cell.ljust(w) for i, (cell, w) in enumerate(zip(line, widths))).rstrip()

    lines = [f"FP8 plan: {converted} of {len(rows)} Linear layers run in FP8", fmt(header)]
    lines += [fmt(line) for line in body]
    share = fp8_flops_share(rows, total_flops_per_token=total_flops_per_token)
    if total_flops_per_token:
        at = f" at seq_len {seq_len}" if seq_len is not None else ""
        basis = f"of the model's training FLOPs per token{at} (attention included)"
    else:
        basis = "of all Linear matmul FLOPs (attention and other ops not counted)"
    lines.append(f"FP8 share: {100 * share:.1f}% {basis}; Linear FLOPs counted as 6*in*out per token (fwd+bwd)")
    return "\n".join(lines)
