"""Incremental decoding for generation (models/common/attention/kv_cache.py): each layer keeps its grouped-query keys, after
the QK-norm and the rotation, and its values; the MoE feed-forward routes each new token on its own."""
from __future__ import annotations

from models.common.attention.gqa_kv_cache import GroupedQueryKVCache
from models.common.attention.kv_cache import DecoderKVCache


class Qwen3MoeKVCache(DecoderKVCache):
    """Keys and values [batch, max_len, kv_heads, head_dim] of every layer."""

    layer_cache_cls = GroupedQueryKVCache
