"""Incremental decoding for generation (models/common/attention/kv_cache.py): each layer keeps its grouped-query keys and values."""
from __future__ import annotations

from models.common.attention.gqa_kv_cache import GroupedQueryKVCache
from models.common.attention.kv_cache import DecoderKVCache


class Llama3KVCache(DecoderKVCache):
    """Keys and values [batch, max_len, kv_heads, head_dim] of every layer."""

    layer_cache_cls = GroupedQueryKVCache
