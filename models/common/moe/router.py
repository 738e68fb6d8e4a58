"""Token-choice top-k router: each token picks its k experts from a linear gate computed in float32.

Group-limited routing (DeepSeek-V3, ``num_groups`` > 1): the experts are split into equal groups, each
group is scored by the sum of its two best selection scores, and a token picks its k experts only from its
``topk_groups`` best groups (with expert parallelism over groups, a token then reaches at most that many
devices).

The gate stays in float32 whatever the run's precision: the scores decide a discrete choice, and a
bf16 rounding of near-tied logits would flip experts from one step to the next.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Literal

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from models.common.init import trunc_normal_

ScoreFunc = Literal["softmax", "sigmoid"]
SCORE_FUNCS: tuple[str, ...] = ("softmax", "sigmoid")


@dataclass(frozen=True)
class Routing:
    """What the router decided for T tokens (all float32 but the indices)."""

    scores: torch.Tensor
    """[T, num_experts] affinity of every token to every expert (softmax or sigmoid of the gate logits);
    the auxiliary loss reads it."""
    weights: torch.Tensor
    """[T, top_k] combine weights of the chosen experts: their scores (not the bias), normalised if asked,
    times route_scale."""
    experts: torch.Tensor
    """[T, top_k] int64 chosen expert ids, in decreasing order of selection score."""


class TokenChoiceRouter(nn.Module):
    """x [T, dim] -> Routing. ``expert_bias`` (aux-loss-free balancing) shifts which experts are chosen,
    never the weights they are combined with (DeepSeek-V3)."""

    high_precision_reason: ClassVar[str] = (
        "router gate: float32 in every recipe (an FP8 rounding of near-tied logits flips the top-k expert choice)")
    """Read by the FP8 plans (torchtitan_lite.protocols.grouped_experts.high_precision_reason)."""

    def __init__(self, dim: int, num_experts: int, top_k: int, *, score_func: ScoreFunc = "softmax",
                 norm_topk_prob: bool = True, route_scale: float = 1.0, num_groups: int = 1,
                 topk_groups: int = 1) -> None:
        super().__init__()
        if score_func not in SCORE_FUNCS:
            raise ValueError(f"router score_func={score_func!r} must be one of {', '.join(SCORE_FUNCS)}")
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"router top_k={top_k} must be between 1 and num_experts={num_experts}")
        check_groups(num_experts, top_k, num_groups, topk_groups)
        self.num_groups = num_groups
        self.topk_groups = topk_groups
        self.num_experts = num_experts
        self.top_k = top_k
        self.score_func = score_func
        self.norm_topk_prob = norm_topk_prob
        self.route_scale = route_scale
        self.gate = nn.Linear(dim, num_experts, bias=False)

    def init_weights(self, std: float) -> None:
        trunc_normal_(self.gate.weight, std=std)

    def forward(self, x: torch.Tensor, expert_bias: torch.Tensor | None = None) -> Routing:
        # Autocast would run the gate in bf16/fp16; the float32 copy of x keeps the logits exact.
        # Under tensor parallelism the gate weight is a replicated DTensor (every rank routes the same tokens):
        # its local copy is the whole matrix.
        weight = self.gate.weight.to_local() if isinstance(self.gate.weight, DTensor) else self.gate.weight
        with torch.autocast(x.device.type, enabled=False):
            logits = F.linear(x.float(), weight.float())
        scores = torch.softmax(logits, dim=-1) if self.score_func == "softmax" else torch.sigmoid(logits)
        selection = scores if expert_bias is None else scores + expert_bias.float()
        if self.num_groups > 1:
            selection = self._mask_groups(selection)
        experts = torch.topk(selection, self.top_k, dim=-1).indices
        weights = scores.gather(-1, experts)
        if self.norm_topk_prob:
            # The tiny epsilon only guards sigmoid scores that all underflow; it cannot move a float32 sum >= 1e-7.
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        if self.route_scale != 1.0:
            weights = weights * self.route_scale
        return Routing(scores=scores, weights=weights, experts=experts)

    def _mask_groups(self, selection: torch.Tensor) -> torch.Tensor:
        """``selection`` [T, E] with every expert outside the token's ``topk_groups`` best groups set to -inf.
        A group's score is the sum of its two best selection scores (DeepSeek-V3's rule, bias included)."""
        grouped = selection.view(selection.shape[0], self.num_groups, -1)
        group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)
        best_groups = group_scores.topk(self.topk_groups, dim=-1).indices
        keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best_groups, True)
        return grouped.masked_fill(~keep.unsqueeze(-1), float("-inf")).view_as(selection)

    def extra_repr(self) -> str:
        groups = f", groups={self.topk_groups} of {self.num_groups}" if self.num_groups > 1 else ""
        return (f"num_experts={self.num_experts}, top_k={self.top_k}, score_func={self.score_func}, "
                f"norm_topk_prob={self.norm_topk_prob}, route_scale={self.route_scale}{groups}")


def check_groups(num_experts: int, top_k: int, num_groups: int, topk_groups: int) -> None:
    """ValueError unless the experts split into ``num_groups`` groups of at least two (a group is scored by its
    best two) and the ``topk_groups`` kept groups hold at least ``top_k`` experts."""
    if num_groups < 1 or num_experts % num_groups:
        raise ValueError(f"router num_groups={num_groups} must be a positive divisor of num_experts={num_experts}")
    if not 1 <= topk_groups <= num_groups:
        raise ValueError(f"router topk_groups={topk_groups} must be between 1 and num_groups={num_groups}")
    per_group = num_experts // num_groups
    if num_groups > 1 and per_group < 2:
        raise ValueError(f"router num_groups={num_groups} leaves {per_group} expert per group; a group is scored by "
                         f"its two best experts, so use at most {num_experts // 2} groups")
    if topk_groups * per_group < top_k:
        raise ValueError(f"router top_k={top_k} exceeds the {topk_groups * per_group} experts of topk_groups="
                         f"{topk_groups} groups of {per_group}; raise topk_groups or lower top_k")
