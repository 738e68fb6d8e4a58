"""The layer cache of grouped-query attention (Llama 3, Qwen3-MoE): each position's rotated keys and its values,
per key/value head."""
from __future__ import annotations

import torch

from models.common.attention.grouped_query import GroupedQueryAttention, repeat_kv
from models.common.attention.kv_cache import attend_cached


class GroupedQueryKVCache:
    """Keys and values [batch, max_len, kv_heads, head_dim] of one GroupedQueryAttention (models/common/attention/kv_cache.py)."""

    def __init__(self, attention: GroupedQueryAttention, *, batch_size: int, max_len: int) -> None:
        self.attention = attention
        weight = attention.wk.weight
        shape = (batch_size, max_len, attention.wk.out_features // attention.head_dim, attention.head_dim)
        self.keys = torch.zeros(shape, dtype=weight.dtype, device=weight.device)
        self.values = torch.zeros(shape, dtype=weight.dtype, device=weight.device)

    def __call__(self, x: torch.Tensor, rope: torch.Tensor, start_pos: int) -> torch.Tensor:
        bsz, new, _ = x.shape
        end = start_pos + new
        # The training forward's own projections, norms (Qwen3's QK-norm) and rotation.
        q, k, v = self.attention.project(x, rope)
        self.keys[:bsz, start_pos:end] = k
        self.values[:bsz, start_pos:end] = v
        n_rep = q.shape[2] // k.shape[2]
        keys = repeat_kv(self.keys[:bsz, :end], n_rep)
        values = repeat_kv(self.values[:bsz, :end], n_rep)
        out = attend_cached(q.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2), start_pos)
        return self.attention.wo(out.transpose(1, 2).reshape(bsz, new, -1))
