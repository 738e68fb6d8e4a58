"""Llama 3 decoder-only transformer with torchtitan module names (see the HF adapter for the mapping)."""
from __future__ import annotations

from collections.abc import Callable
from typing import cast

import torch
from torch import nn

from models.common.feed_forward import FeedForward
from models.common.init import trunc_normal_
from models.common.rms_norm import RMSNorm
from models.common.rope import RotaryEmbedding
from models.llama3.args import Llama3ModelArgs, RopeScaling
from models.llama3.attention import Attention
from torchtitan_lite.protocols.model import BaseModel

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


class Transformer(BaseModel):
    """tokens [batch, seq] -> logits [batch, seq, vocab]. Build on meta, then `to_empty` + `init_weights`."""

    def __init__(self, args: Llama3ModelArgs) -> None:
        super().__init__()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.rope = RotaryEmbedding(args.head_dim, args.max_seq_len, args.rope_theta, args.rope_scaling)
        self.layers = nn.ModuleDict({str(i): TransformerBlock(i, args) for i in range(args.n_layers)})
        self.norm = RMSNorm(args.dim, eps=args.norm_eps)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        self.tie_embeddings()
        self.init_weights()

    def tie_embeddings(self) -> None:
        """Make output share tok_embeddings.weight when the args tie them (no-op otherwise or when already shared).

        Call again after anything that replaces parameters, e.g. tensor parallelism distributing each
        module separately, and before fully_shard so that FSDP sees one parameter."""
        if self.args.tie_word_embeddings and self.output.weight is not self.tok_embeddings.weight:
            self.output.weight = self.tok_embeddings.weight

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> Transformer:
        # Moving off the meta device gives each module its own new Parameter, which would silently
        # untie a shared embedding; restore the sharing after every conversion.
        super()._apply(fn, recurse)
        self.tie_embeddings()
        return self

    @torch.no_grad()
    def init_weights(self, buffer_device: torch.device | str | None = None) -> None:
        """Initialise every parameter in place and recompute the rotary table on `buffer_device`.

        Untied embeddings get normal(0, 1) (torchtitan's choice): every block reads the residual stream
        through an RMSNorm, so the scale costs nothing there, and a unit-scale stream keeps the first updates
        of the small-init projections gentle relative to it. A tied matrix is also the output projection,
        so it gets the output's std dim**-0.5 instead, which starts the logits near unit scale.
        """
        self.rope.reset_cache(buffer_device)
        out_std = self.args.dim ** -0.5
        if self.args.tie_word_embeddings:
            trunc_normal_(self.tok_embeddings.weight, std=out_std)
        else:
            nn.init.normal_(self.tok_embeddings.weight, mean=0.0, std=1.0)
            trunc_normal_(self.output.weight, std=out_std)
        for layer in self.layers.values():
            cast(TransformerBlock, layer).init_weights()
        self.norm.reset_parameters()

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        if tokens.shape[1] > self.args.max_seq_len:
            raise ValueError(
                f"sequence length {tokens.shape[1]} exceeds the model's max_seq_len={self.args.max_seq_len}; "
                "shorten training.seq_len or use a flavor with a longer max_seq_len"
            )
        h = self.tok_embeddings(tokens)
        for layer in self.layers.values():
            h = layer(h, self.rope.cache)
        return self.output(self.norm(h))

    def num_params(self, exclude_embedding: bool = False) -> int:
        """Parameter count (a tied matrix counted once); global sizes for DTensor-sharded models."""
        total = sum(p.numel() for p in self.parameters())
        if exclude_embedding:
            total -= self.tok_embeddings.weight.numel()
        return total

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
