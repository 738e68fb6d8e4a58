"""Incremental decoding for generation: a decoder's forward pass with each layer's attention cache.

The training forward (``Decoder.forward``) is untouched: this module reads the same submodules and weights
and repeats their arithmetic for a chunk of new positions, so that every new token costs one position's
work instead of the whole prefix's. What a layer keeps per position is its attention's business: a family
opts in by naming its layer cache (``DecoderKVCache.layer_cache_cls``) and registering the subclass as its
``ModelSpec.kv_cache_cls``; the generator only calls it.
"""
from __future__ import annotations

from typing import ClassVar, Protocol, cast

import torch
import torch.nn.functional as F
from torch import nn

from models.common.decoder import Decoder
from models.common.pre_norm_block import PreNormBlock


class LayerKVCache(Protocol):
    """One block's attention with what it keeps of every position seen so far.

    Built as ``cls(attention, batch_size=, max_len=)``; called with the normalised new positions
    x [batch, new, dim], their rows of the rotary table and the position of the first, it stores them and
    returns the attention output [batch, new, dim] over every position up to the last new one."""

    def __init__(self, attention: nn.Module, *, batch_size: int, max_len: int) -> None: ...
    def __call__(self, x: torch.Tensor, rope: torch.Tensor, start_pos: int) -> torch.Tensor: ...


class DecoderKVCache:
    """The cache of every layer for ``batch_size`` sequences of up to ``max_len`` positions.

    ``cache(tokens, start_pos)`` runs the new tokens [batch, new] that sit at positions
    ``start_pos .. start_pos + new - 1`` and returns their logits [batch, new, vocab]; the caller feeds
    positions in order (a prompt, then one token at a time)."""

    layer_cache_cls: ClassVar[type[LayerKVCache]]
    """What each block's attention keeps: the family's choice."""

    def __init__(self, model: Decoder, *, batch_size: int, max_len: int) -> None:
        if max_len > model.args.max_seq_len:
            raise ValueError(f"generation needs {max_len} positions but the model's max_seq_len is "
                             f"{model.args.max_seq_len}; shorten the prompt or --max-new-tokens")
        self.model = model
        self.max_len = max_len
        self.blocks = [cast(PreNormBlock, block) for block in model.layers.values()]
        self.layers = [self.layer_cache_cls(block.attention, batch_size=batch_size, max_len=max_len)
                       for block in self.blocks]

    @torch.no_grad()
    def __call__(self, tokens: torch.Tensor, start_pos: int) -> torch.Tensor:
        end = start_pos + tokens.shape[1]
        if end > self.max_len:
            raise ValueError(f"position {end - 1} is beyond the cache's {self.max_len} positions")
        model = self.model
        assert model.tok_embeddings is not None and model.norm is not None and model.output is not None
        rope = model.rope.cache[start_pos:end]
        h = model.tok_embeddings(tokens)
        for block, layer in zip(self.blocks, self.layers):  # PreNormBlock.forward, attention from the cache
            h = h + layer(block.attention_norm(h), rope, start_pos)
            h = h + block.ffn()(block.ffn_norm(h))
        return model.output(model.norm(h))


def attend_cached(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start_pos: int,
                  scale: float | None = None) -> torch.Tensor:
    """SDPA of the new positions' queries q [batch, heads, new, d] over every cached key / value
    [batch, heads, end, d] (end = start_pos + new); ``scale`` as in F.scaled_dot_product_attention.

    New position p attends to cached positions 0..p: with an empty cache this is the usual causal mask, and
    a single new token sees everything cached."""
    new, end = q.shape[2], k.shape[2]
    if start_pos == 0:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
    if new == 1:
        return F.scaled_dot_product_attention(q, k, v, scale=scale)
    mask = torch.ones(new, end, dtype=torch.bool, device=q.device).tril(diagonal=start_pos)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
