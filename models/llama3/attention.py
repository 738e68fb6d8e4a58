"""Causal grouped-query self-attention with rotary embeddings."""
from __future__ import annotations

import torch
from torch import nn

from models.common.attention import grouped_query_attention
from models.common.init import trunc_normal_
from models.common.rope import apply_rotary_emb
from models.llama3.args import Llama3ModelArgs


class Attention(nn.Module):
    def __init__(self, args: Llama3ModelArgs) -> None:
        super().__init__()
        self.head_dim = args.head_dim
        self.wq = nn.Linear(args.dim, args.n_heads * args.head_dim, bias=False)
        self.wk = nn.Linear(args.dim, args.kv_heads * args.head_dim, bias=False)
        self.wv = nn.Linear(args.dim, args.kv_heads * args.head_dim, bias=False)
        self.wo = nn.Linear(args.n_heads * args.head_dim, args.dim, bias=False)

    def init_weights(self, out_proj_std: float) -> None:
        for linear in (self.wq, self.wk, self.wv):
            trunc_normal_(linear.weight, std=0.02)
        trunc_normal_(self.wo.weight, std=out_proj_std)

    def forward(self, x: torch.Tensor, rope_cache: torch.Tensor) -> torch.Tensor:
        bsz, seqlen, _ = x.shape
        # Head counts come from the projections' outputs, not from the args: under tensor parallelism each
        # rank holds n_heads / tp query heads and n_kv_heads / tp key/value heads.
        q = self.wq(x).view(bsz, seqlen, -1, self.head_dim)
        k = self.wk(x).view(bsz, seqlen, -1, self.head_dim)
        v = self.wv(x).view(bsz, seqlen, -1, self.head_dim)
        q = apply_rotary_emb(q, rope_cache)
        k = apply_rotary_emb(k, rope_cache)
        return self.wo(grouped_query_attention(q, k, v))
