"""Qwen3-MoE decoder-only transformer: GQA with QK-norm and an MoE feed-forward in every block.

Module names follow the Llama 3 family (tok_embeddings, layers.<i>.attention / attention_norm / ffn_norm,
norm, output) so that the parallelisms and tools that read a plan by name work unchanged; the MoE lives in
layers.<i>.moe (models/common/moe.py). The HF adapter maps the names.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import cast

import torch
import torch.distributed as dist
from torch import nn

from models.common.init import trunc_normal_
from models.common.moe import MoE
from models.common.moe_hooks import moe_aux_loss, update_expert_biases
from models.common.rms_norm import RMSNorm
from models.common.rope import RotaryEmbedding
from models.common.router_stats import router_stats, router_summary
from models.qwen3_moe.args import Qwen3MoeModelArgs
from models.qwen3_moe.attention import Attention
from torchtitan_lite.protocols.model import BaseModel


class Qwen3MoeBlock(nn.Module):
    def __init__(self, layer_id: int, args: Qwen3MoeModelArgs) -> None:
        super().__init__()
        self.attention = Attention(args)
        self.attention_norm = RMSNorm(args.dim, eps=args.norm_eps)
        self.moe = MoE(args.dim, args.moe)
        self.ffn_norm = RMSNorm(args.dim, eps=args.norm_eps)
        depth = layer_id + 1 if args.depth_init else args.n_layers
        self.out_proj_std = 0.02 / (2 * depth) ** 0.5

    def init_weights(self) -> None:
        self.attention_norm.reset_parameters()
        self.ffn_norm.reset_parameters()
        self.attention.init_weights(self.out_proj_std)
        self.moe.init_weights(self.out_proj_std)

    def forward(self, x: torch.Tensor, rope_cache: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), rope_cache)
        return h + self.moe(self.ffn_norm(h))


class Qwen3MoeModel(BaseModel):
    """tokens [batch, seq] -> logits [batch, seq, vocab]. Build on meta, then `to_empty` + `init_weights`."""

    def __init__(self, args: Qwen3MoeModelArgs) -> None:
        super().__init__()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.rope = RotaryEmbedding(args.head_dim, args.max_seq_len, args.rope_theta, None)
        self.layers = nn.ModuleDict({str(i): Qwen3MoeBlock(i, args) for i in range(args.n_layers)})
        self.norm = RMSNorm(args.dim, eps=args.norm_eps)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        self.tie_embeddings()
        self.init_weights()

    def tie_embeddings(self) -> None:
        """Make output share tok_embeddings.weight when the args tie them (see the Llama 3 model)."""
        if self.args.tie_word_embeddings and self.output.weight is not self.tok_embeddings.weight:
            self.output.weight = self.tok_embeddings.weight

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> Qwen3MoeModel:
        super()._apply(fn, recurse)
        self.tie_embeddings()
        return self

    @torch.no_grad()
    def init_weights(self, buffer_device: torch.device | str | None = None) -> None:
        """Initialise every parameter and buffer in place (the Llama 3 scheme; routers at std 0.02)."""
        self.rope.reset_cache(buffer_device)
        out_std = self.args.dim ** -0.5
        if self.args.tie_word_embeddings:
            trunc_normal_(self.tok_embeddings.weight, std=out_std)
        else:
            nn.init.normal_(self.tok_embeddings.weight, mean=0.0, std=1.0)
            trunc_normal_(self.output.weight, std=out_std)
        for layer in self.layers.values():
            cast(Qwen3MoeBlock, layer).init_weights()
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

    def aux_loss(self) -> torch.Tensor | None:
        """The MoE layers' summed load-balancing loss of the latest training forward (None when off)."""
        return moe_aux_loss(self)

    def post_optimizer_step(self, dp_group: dist.ProcessGroup | None) -> None:
        """Move every layer's expert bias toward balance from the loads of the step (when the bias is on)."""
        update_expert_biases(self, dp_group)

    def training_stats(self, dp_group: dist.ProcessGroup | None) -> dict[str, torch.Tensor]:
        """The routers' load balance since the previous call (models/common/router_stats.py)."""
        return router_stats(self, dp_group)

    def training_stats_summary(self, values: dict[str, float]) -> str | None:
        return router_summary(values)

    def num_params(self, exclude_embedding: bool = False) -> int:
        """Parameter count, every expert included (a tied matrix counted once)."""
        total = sum(p.numel() for p in self.parameters())
        if exclude_embedding:
            total -= self.tok_embeddings.weight.numel()
        return total

    def num_active_params(self, exclude_embedding: bool = False) -> int:
        """Parameters one token uses: all but the routed experts it is not sent to."""
        m = self.args.moe
        idle_experts = m.num_experts - m.top_k
        return self.num_params(exclude_embedding) - self.args.n_layers * idle_experts * 3 * self.args.dim * m.hidden_dim

    def flops_per_token(self, seq_len: int) -> int:
        """Training FLOPs per token (forward + backward): 6 * active matmul parameters + the attention term
        12 * n_layers * n_heads * head_dim * seq_len, as Llama 3's estimate, counting only the experts a
        token is routed to."""
        a = self.args
        matmul_params = self.num_active_params(exclude_embedding=True)
        if a.tie_word_embeddings:
            matmul_params += self.output.weight.numel()
        return 6 * matmul_params + 12 * a.n_layers * a.n_heads * a.head_dim * seq_len
