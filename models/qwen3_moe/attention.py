"""Causal grouped-query attention with QK-norm: an RMSNorm over each head's channels of q and k, before
the rotary embedding (Qwen3). head_dim is a model argument, not dim / n_heads."""
from __future__ import annotations

import torch
from torch import nn

from models.common.attention import grouped_query_attention
from models.common.init import trunc_normal_
from models.common.rms_norm import RMSNorm
from models.common.rope import apply_rotary_emb
from models.qwen3_moe.args import Qwen3MoeModelArgs


class Attention(nn.Module):
    def __init__(self, args: Qwen3MoeModelArgs) -> None:
        super().__init__()
        self.head_dim = args.head_dim
        self.wq = nn.Linear(args.dim, args.n_heads * args.head_dim, bias=False)
        self.wk = nn.Linear(args.dim, args.n_kv_heads * args.head_dim, bias=False)
        self.wv = nn.Linear(args.dim, args.n_kv_heads * args.head_dim, bias=False)
        self.wo = nn.Linear(args.n_heads * args.head_dim, args.dim, bias=False)
        self.q_norm = RMSNorm(args.head_dim, eps=args.norm_eps)
        self.k_norm = RMSNorm(args.head_dim, eps=args.norm_eps)

    def init_weights(self, out_proj_std: float) -> None:
        for linear in (self.wq, self.wk, self.wv):
            trunc_normal_(linear.weight, std=0.02)
        trunc_normal_(self.wo.weight, std=out_proj_std)
        self.q_norm.reset_parameters()
        self.k_norm.reset_parameters()

    def forward(self, x: torch.Tensor, rope_cache: torch.Tensor) -> torch.Tensor:
        bsz, seqlen, _ = x.shape
        q = self.q_norm(self.wq(x).view(bsz, seqlen, -1, self.head_dim))
        k = self.k_norm(self.wk(x).view(bsz, seqlen, -1, self.head_dim))
        v = self.wv(x).view(bsz, seqlen, -1, self.head_dim)
        q = apply_rotary_emb(q, rope_cache)
        k = apply_rotary_emb(k, rope_cache)
        return self.wo(grouped_query_attention(q, k, v))
