"""Llama 3 decoder-only transformer with torchtitan module names (see the HF adapter for the mapping)."""
from __future__ import annotations

import torch
from torch import nn

from models.common.decoder import Decoder
from models.common.feed_forward import FeedForward
from models.common.rms_norm import RMSNorm
from models.llama3.args import Llama3ModelArgs, RopeScaling
from models.llama3.attention import Attention

__all__ = ["Llama3ModelArgs", "RopeScaling", "RMSNorm", "FeedForward", "TransformerBlock", "Transformer"]


class TransformerBlock(nn.Module):
    def __init__(self, layer_id: int, args: Llama3ModelArgs) -> None:
        super().__init__()
        self.attention = Attention(args)
        self.attention_norm = RMSNorm(args.dim, eps=args.norm_eps)
        self.feed_forward = FeedForward(args.dim, args.ffn_hidden_dim)
        self.ffn_norm = RMSNorm(args.dim, eps=args.norm_eps)
        # Smaller init for the projections that write into the residual stream keeps its variance from
        # growing with depth (GPT-2 / torchtitan scheme).
        depth = layer_id + 1 if args.depth_init else args.n_layers
        self.out_proj_std = 0.02 / (2 * depth) ** 0.5

    def init_weights(self) -> None:
        self.attention_norm.reset_parameters()
        self.ffn_norm.reset_parameters()
        self.attention.init_weights(self.out_proj_std)
        self.feed_forward.init_weights(self.out_proj_std)

    def forward(self, x: torch.Tensor, rope_cache: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), rope_cache)
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(Decoder[Llama3ModelArgs]):
    """tokens [batch, seq] -> logits [batch, seq, vocab]. Build on meta, then `to_empty` + `init_weights`."""

    def __init__(self, args: Llama3ModelArgs) -> None:
        super().__init__(args, lambda i: TransformerBlock(i, args), rope_scaling=args.rope_scaling)

    def flops_per_token(self, seq_len: int) -> int:
        """Training FLOPs (forward + backward) per token, the PaLM / torchtitan estimate:

            6 * N + 12 * n_layers * n_heads * head_dim * seq_len

        N counts the parameters used in matmuls for each token (all but the embedding lookup; a tied matrix
        counts as the output projection): 2 FLOPs per multiply-add in forward, twice that in backward.
        The second term is the attention scores and their weighted sum (2 matmuls of seq_len * head_dim per
        head), counted over the full score matrix, not just its causal half.
        """
        a = self.args
        matmul_params = self.num_params(exclude_embedding=True)
        if a.tie_word_embeddings:
            matmul_params += self.output.weight.numel()
        return 6 * matmul_params + 12 * a.n_layers * a.n_heads * a.head_dim * seq_len
