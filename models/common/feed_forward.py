"""SwiGLU feed-forward: the dense MLP of Llama-style blocks and the shared expert of an MoE layer."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from models.common.init import trunc_normal_


class FeedForward(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x)."""

    def __init__(self, dim: int, hidden_dim: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def init_weights(self, out_proj_std: float) -> None:
        trunc_normal_(self.w1.weight, std=0.02)
        for linear in (self.w2, self.w3):
            trunc_normal_(linear.weight, std=out_proj_std)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))
