"""Qwen3-MoE decoder-only transformer: GQA with QK-norm and an MoE feed-forward in every block.

Module names follow the Llama 3 family (tok_embeddings, layers.<i>.attention / attention_norm / ffn_norm,
norm, output) so that the parallelisms and tools that read a plan by name work unchanged; the MoE lives in
layers.<i>.moe (models/common/moe/layer.py). The HF adapter maps the names.
"""
from __future__ import annotations

from models.common.moe.decoder import MoEDecoder
from models.common.moe.layer import MoE
from models.common.pre_norm_block import PreNormBlock
from models.qwen3_moe.args import Qwen3MoeModelArgs
from models.qwen3_moe.attention import Attention


class Qwen3MoeBlock(PreNormBlock):
    """QK-norm attention and an MoE feed-forward (`moe`), each behind an RMSNorm on a residual branch."""

    attention: Attention
    moe: MoE

    def __init__(self, layer_id: int, args: Qwen3MoeModelArgs) -> None:
        super().__init__(layer_id, args, Attention(args), "moe", MoE(args.dim, args.moe))


class Qwen3MoeModel(MoEDecoder[Qwen3MoeModelArgs]):
    """tokens [batch, seq] -> logits [batch, seq, vocab]. Build on meta, then `to_empty` + `init_weights`.

    The skeleton (embedding, rotary table, init outside the blocks, forward) is models/common/decoder.py, the
    MoE hooks the trainer calls models/common/moe/decoder.py; the routers start at std 0.02
    (models/common/moe/router.py)."""

    def __init__(self, args: Qwen3MoeModelArgs) -> None:
        super().__init__(args, lambda i: Qwen3MoeBlock(i, args))
