"""What a converter needs of a model's routed experts: 3-D weights and one replaceable grouped GEMM.

The models side (models/common/moe/experts.py ``GroupedExperts``) satisfies it; converters under torchtitan_lite
find such modules by this shape, without importing any model family.
"""
from __future__ import annotations

from typing import ClassVar, Protocol, runtime_checkable

import torch
from torch import nn


@runtime_checkable
class GroupedGemmExperts(Protocol):
    """Routed experts computed as grouped GEMMs: ``grouped_mm(x, w, offsets)`` is their only GEMM."""

    grouped_gemm_weights: ClassVar[tuple[str, ...]]
    """Names of the 3-D expert weights [E, out, in] (nn.Linear's layout per expert), each one grouped GEMM."""
    num_experts: int
    use_grouped_mm: bool
    """False: the experts run their per-expert loop reference, which does not call ``grouped_mm``."""

    def grouped_mm(self, x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        """x [N, in] @ w [E, in, out] per token group (int32 cumulative ``offsets``, last == N) -> [N, out]."""
        ...


def grouped_gemm_experts(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(fqn, module) of every grouped-GEMM expert module of ``model``, in module order."""
    return [(fqn, module) for fqn, module in model.named_modules() if _is_grouped_experts(module)]


def _is_grouped_experts(module: nn.Module) -> bool:
    return isinstance(getattr(type(module), "grouped_gemm_weights", None), tuple) and isinstance(
        module, GroupedGemmExperts)


def high_precision_reason(module: nn.Module) -> str:
    """Why a model keeps ``module`` (and every Linear in it) in high precision under any FP8 recipe, or ''. A
    module declares it with a ``high_precision_reason`` class attribute (the MoE router does)."""
    reason = getattr(type(module), "high_precision_reason", "")
    return reason if isinstance(reason, str) else ""
