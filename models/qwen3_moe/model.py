"""Qwen3-MoE decoder-only transformer: GQA with QK-norm and an MoE feed-forward in every block.

Module names follow the Llama 3 family (tok_embeddings, layers.<i>.attention / attention_norm / ffn_norm,
norm, output) so that the parallelisms and tools that read a plan by name work unchanged; the MoE lives in
layers.<i>.moe (models/common/moe.py). The HF adapter maps the names.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from models.common.decoder import Decoder
from models.common.moe import MoE
from models.common.moe_hooks import set_aux_loss_scale, update_expert_biases
from models.common.pre_norm_block import PreNormBlock
from models.common.router_stats import merge_router_stats, router_stats, router_summary
from models.qwen3_moe.args import Qwen3MoeModelArgs
from models.qwen3_moe.attention import Attention
from torchtitan_lite.protocols.moe_facts import MoEFacts


class Qwen3MoeBlock(PreNormBlock):
    """QK-norm attention and an MoE feed-forward (`moe`), each behind an RMSNorm on a residual branch."""

    attention: Attention
    moe: MoE

    def __init__(self, layer_id: int, args: Qwen3MoeModelArgs) -> None:
        super().__init__(layer_id, args, Attention(args), "moe", MoE(args.dim, args.moe))


class Qwen3MoeModel(Decoder[Qwen3MoeModelArgs]):
    """tokens [batch, seq] -> logits [batch, seq, vocab]. Build on meta, then `to_empty` + `init_weights`.

    The skeleton (embedding, rotary table, init outside the blocks, forward) is models/common/decoder.py;
    the routers start at std 0.02 (models/common/router.py)."""

    def __init__(self, args: Qwen3MoeModelArgs) -> None:
        super().__init__(args, lambda i: Qwen3MoeBlock(i, args))

    def set_aux_loss_scale(self, scale: float) -> None:
        """Weight of the MoE layers' balance loss in the coming backward passes."""
        set_aux_loss_scale(self, scale)

    def post_optimizer_step(self, dp_group: dist.ProcessGroup | None) -> None:
        """Move every layer's expert bias toward balance from the loads of the step (when the bias is on)."""
        update_expert_biases(self, dp_group)

    def training_stats(self, dp_group: dist.ProcessGroup | None) -> dict[str, torch.Tensor]:
        """The routers' load balance since the previous call (models/common/router_stats.py)."""
        return router_stats(self, dp_group)

    def merge_training_stats(self, parts: list[dict[str, float]]) -> dict[str, float]:
        return merge_router_stats(parts)

    def training_stats_summary(self, values: dict[str, float]) -> str | None:
        return router_summary(values)

    def moe_facts(self) -> MoEFacts:
        return self.args.moe_facts()
