"""Llama 3 decoder-only transformer with torchtitan module names (see the HF adapter for the mapping)."""
from __future__ import annotations

from models.common.decoder import Decoder
from models.common.feed_forward import FeedForward
from models.common.pre_norm_block import PreNormBlock
from models.common.rms_norm import RMSNorm
from models.llama3.args import Llama3ModelArgs, RopeScaling
from models.llama3.attention import Attention

__all__ = ["Llama3ModelArgs", "RopeScaling", "RMSNorm", "FeedForward", "TransformerBlock", "Transformer"]


class TransformerBlock(PreNormBlock):
    """Attention and a SwiGLU feed-forward (`feed_forward`), each behind an RMSNorm on a residual branch."""

    attention: Attention
    feed_forward: FeedForward

    def __init__(self, layer_id: int, args: Llama3ModelArgs) -> None:
        super().__init__(layer_id, args, Attention(args), "feed_forward", FeedForward(args.dim, args.ffn_hidden_dim))


class Transformer(Decoder[Llama3ModelArgs]):
    """tokens [batch, seq] -> logits [batch, seq, vocab]. Build on meta, then `to_empty` + `init_weights`."""

    def __init__(self, args: Llama3ModelArgs) -> None:
        super().__init__(args, lambda i: TransformerBlock(i, args), rope_scaling=args.rope_scaling)
