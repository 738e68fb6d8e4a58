"""Incremental decoding for generation: the Llama forward pass with a key/value cache.

The training forward (``Transformer.forward``) is untouched: this module reads the same submodules and
weights and repeats their arithmetic for a chunk of new positions, keeping each layer's keys and values
so that every new token costs one position's work instead of the whole prefix's.
"""
from __future__ import annotations

from typing import cast

import torch
import torch.nn.functional as F

from models.common.attention import repeat_kv
from models.common.rope import apply_rotary_emb
from models.llama3.attention import Attention
from models.llama3.model import Transformer, TransformerBlock


class Llama3KVCache:
    """Keys and values of every layer for ``batch_size`` sequences of up to ``max_len`` positions.

    ``cache(tokens, start_pos)`` runs the new tokens [batch, new] that sit at positions
    ``start_pos .. start_pos + new - 1`` and returns their logits [batch, new, vocab]; the caller feeds
    positions in order (a prompt, then one token at a time).
    """

    def __init__(self, model: Transformer, *, batch_size: int, max_len: int) -> None:
        args = model.args
        if max_len > args.max_seq_len:
            raise ValueError(f"generation needs {max_len} positions but the model's max_seq_len is "
                             f"{args.max_seq_len}; shorten the prompt or --max-new-tokens")
        self.model = model
        self.max_len = max_len
        weight = model.tok_embeddings.weight
        n_kv = args.n_kv_heads or args.n_heads
        shape = (len(model.layers), batch_size, max_len, n_kv, args.head_dim)
        self.keys = torch.zeros(shape, dtype=weight.dtype, device=weight.device)
        self.values = torch.zeros(shape, dtype=weight.dtype, device=weight.device)

    @torch.no_grad()
    def __call__(self, tokens: torch.Tensor, start_pos: int) -> torch.Tensor:
        end = start_pos + tokens.shape[1]
        if end > self.max_len:
            raise ValueError(f"position {end - 1} is beyond the cache's {self.max_len} positions")
        rope = self.model.rope.cache[start_pos:end]
        h = self.model.tok_embeddings(tokens)
        for i, layer in enumerate(self.model.layers.values()):
            h = self._block(i, cast(TransformerBlock, layer), h, rope, start_pos)
        return self.model.output(self.model.norm(h))

    def _block(self, i: int, layer: TransformerBlock, x: torch.Tensor, rope: torch.Tensor, start_pos: int) -> torch.Tensor:
        h = x + self._attention(i, layer.attention, layer.attention_norm(x), rope, start_pos)
        return h + layer.feed_forward(layer.ffn_norm(h))

    def _attention(self, i: int, attn: Attention, x: torch.Tensor, rope: torch.Tensor, start_pos: int) -> torch.Tensor:
        bsz, new, _ = x.shape
        end = start_pos + new
        q = apply_rotary_emb(attn.wq(x).view(bsz, new, -1, attn.head_dim), rope)
        k = apply_rotary_emb(attn.wk(x).view(bsz, new, -1, attn.head_dim), rope)
        self.keys[i, :bsz, start_pos:end] = k
        self.values[i, :bsz, start_pos:end] = attn.wv(x).view(bsz, new, -1, attn.head_dim)
        n_rep = q.shape[2] // k.shape[2]
        keys = repeat_kv(self.keys[i, :bsz, :end], n_rep)
        values = repeat_kv(self.values[i, :bsz, :end], n_rep)
        # New position p attends to cached positions 0..p: with an empty cache this is the usual causal
        # mask, and a single new token sees everything cached.
        if start_pos == 0:
            out = F.scaled_dot_product_attention(q.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2),
                                                 is_causal=True)
        elif new == 1:
            out = F.scaled_dot_product_attention(q.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2))
        else:
            mask = torch.ones(new, end, dtype=torch.bool, device=x.device).tril(diagonal=start_pos)
            out = F.scaled_dot_product_attention(q.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2),
                                                 attn_mask=mask)
        return attn.wo(out.transpose(1, 2).reshape(bsz, new, -1))
