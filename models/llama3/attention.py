"""Causal grouped-query self-attention with rotary embeddings (models/common/attention/grouped_query.py);
head_dim = dim / n_heads."""
from __future__ import annotations

from models.common.attention.grouped_query import GroupedQueryAttention
from models.llama3.args import Llama3ModelArgs


class Attention(GroupedQueryAttention):
    def __init__(self, args: Llama3ModelArgs) -> None:
        super().__init__(args.dim, args.n_heads, args.kv_heads, args.head_dim)
