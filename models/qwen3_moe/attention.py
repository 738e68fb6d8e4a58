"""Causal grouped-query attention with QK-norm: an RMSNorm over each head's channels of q and k, before
the rotary embedding (Qwen3). head_dim is a model argument, not dim / n_heads."""
from __future__ import annotations

import torch

from models.common.attention.grouped_query import GroupedQueryAttention
from models.common.rms_norm import RMSNorm
from models.qwen3_moe.args import Qwen3MoeModelArgs


class Attention(GroupedQueryAttention):
    def __init__(self, args: Qwen3MoeModelArgs) -> None:
        super().__init__(args.dim, args.n_heads, args.n_kv_heads, args.head_dim)
        self.q_norm = RMSNorm(args.head_dim, eps=args.norm_eps)
        self.k_norm = RMSNorm(args.head_dim, eps=args.norm_eps)

    def init_weights(self, out_proj_std: float) -> None:
        super().init_weights(out_proj_std)
        self.q_norm.reset_parameters()
        self.k_norm.reset_parameters()

    def norm_qk(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.q_norm(q), self.k_norm(k)
