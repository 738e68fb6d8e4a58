"""Incremental decoding for generation (models/common/attention/kv_cache.py) with multi-head latent attention's cache.

Each layer keeps, per position, only what ``MultiHeadLatentAttention.compressed_kv`` gives: the normalised
latent (kv_lora_rank channels) and the rotated key channels every head shares (qk_rope_head_dim), not the
n_heads * (qk_nope_head_dim + v_head_dim) channels ``wkv_b`` expands them to (576 against 32,768 channels
per position and layer at DeepSeek-V3's size). The new queries attend to the latent directly, as DeepSeek's
reference inference does ("absorb"): ``wkv_b``'s key rows fold into each head's query, q_nope . (W_uk c) =
(W_uk^T q_nope) . c, and its value rows apply once to the attended latent, sum_t p_t (W_uv c_t) =
W_uv (sum_t p_t c_t). The same products as the training forward, summed in another order.
"""
from __future__ import annotations

import torch

from models.common.attention.kv_cache import DecoderKVCache, attend_cached
from models.deepseek_v3.attention import MultiHeadLatentAttention


class LatentKVCache:
    """[batch, max_len, kv_lora_rank + qk_rope_head_dim] of one MultiHeadLatentAttention: each position's
    normalised latent, then its rotated shared key channels."""

    def __init__(self, attention: MultiHeadLatentAttention, *, batch_size: int, max_len: int) -> None:
        self.attention = attention
        weight = attention.wkv_a.weight
        self.cache = torch.zeros(batch_size, max_len, attention.kv_lora_rank + attention.rope_dim,
                                 dtype=weight.dtype, device=weight.device)

    def __call__(self, x: torch.Tensor, rope: torch.Tensor, start_pos: int) -> torch.Tensor:
        attn = self.attention
        bsz, new, _ = x.shape
        end = start_pos + new
        q_nope, q_rope = attn.query_heads(x, rope)
        latent, k_rope = attn.compressed_kv(x, rope)
        self.cache[:bsz, start_pos:end] = torch.cat([latent, k_rope.squeeze(2)], dim=-1)
        heads = q_nope.shape[2]
        w_uk, w_uv = attn.wkv_b.weight.view(heads, attn.nope_dim + attn.v_dim, -1).split(
            [attn.nope_dim, attn.v_dim], dim=1)
        q_latent = torch.einsum("bshd,hdc->bhsc", q_nope, w_uk)
        q = torch.cat([q_latent, q_rope.transpose(1, 2)], dim=-1)  # [batch, heads, new, rank + rope]
        # One key / value row per position, read by every head (views, not copies).
        keys = self.cache[:bsz, None, :end].expand(-1, heads, -1, -1)
        values = keys[..., :attn.kv_lora_rank]
        out = attend_cached(q, keys, values, start_pos, scale=attn.softmax_scale)  # [batch, heads, new, rank]
        out = torch.einsum("bhsc,hdc->bshd", out, w_uv)
        return attn.wo(out.reshape(bsz, new, -1))


class DeepSeekV3KVCache(DecoderKVCache):
    """The compressed latent and the shared rotary key of every layer, dense and MoE blocks alike."""

    layer_cache_cls = LatentKVCache
