"""DeepSeek-V3 decoder: multi-head latent attention in every block; a dense SwiGLU in the first
n_dense_layers blocks and DeepSeekMoE (sigmoid router with group-limited top-k and the auxiliary-loss-free
expert bias, shared experts) in the rest. Multi-token prediction is not part of the model.

Module names follow the Llama 3 family (tok_embeddings, layers.<i>.attention / attention_norm / ffn_norm,
norm, output); a dense block's feed-forward is layers.<i>.feed_forward, an MoE block's layers.<i>.moe
(models/common/moe/layer.py). The HF adapter maps the names.
"""
from __future__ import annotations

from models.common.feed_forward import FeedForward
from models.common.moe.decoder import MoEDecoder
from models.common.moe.layer import MoE
from models.common.pre_norm_block import PreNormBlock
from models.deepseek_v3.args import DeepSeekV3ModelArgs
from models.deepseek_v3.attention import MultiHeadLatentAttention


class DeepSeekV3Block(PreNormBlock):
    """Latent attention and a dense (`feed_forward`) or MoE (`moe`) feed-forward, each behind an RMSNorm."""

    attention: MultiHeadLatentAttention

    def __init__(self, layer_id: int, args: DeepSeekV3ModelArgs) -> None:
        if layer_id < args.n_dense_layers:
            super().__init__(layer_id, args, MultiHeadLatentAttention(args), "feed_forward",
                             FeedForward(args.dim, args.dense_hidden_dim))
        else:
            super().__init__(layer_id, args, MultiHeadLatentAttention(args), "moe", MoE(args.dim, args.moe))


class DeepSeekV3Model(MoEDecoder[DeepSeekV3ModelArgs]):
    """tokens [batch, seq] -> logits [batch, seq, vocab]. Build on meta, then `to_empty` + `init_weights`.

    The rotary table covers only the qk_rope_head_dim channels of each head, YaRN-scaled when the args say."""

    def __init__(self, args: DeepSeekV3ModelArgs) -> None:
        super().__init__(args, lambda i: DeepSeekV3Block(i, args), rope_scaling=args.rope_scaling,
                         rope_dim=args.qk_rope_head_dim)

    def high_precision_parts(self) -> list[tuple[str, str]]:
        """What DeepSeek-V3's FP8 recipe keeps in BF16 / FP32 (section 3.3.1 of its report), and where we differ."""
        return [
            ("tok_embeddings", "embedding lookup, no GEMM; the report keeps the embedding module high precision"),
            ("output", "output head: the logits feed the softmax and the loss (keep_output_hp)"),
            ("layers.*.moe.router.gate", "MoE gating: the router computes its logits in float32 from the gate's "
                                         "weight whatever the recipe (a discrete choice of experts); name 'router.gate' "
                                         "in filter_fqns so that the plan does not count it as converted"),
            ("norms (attention_norm, ffn_norm, attention.q_norm / kv_norm, norm)", "normalisation operators"),
            ("attention core", "softmax(q k^T) v stays in the compute dtype: the report's attention operators"),
            ("layers.*.moe.experts", "routed experts run grouped GEMMs, which a Linear recipe does not swap: the "
                                     "moe_experts converter's plan gives their recipe (blockwise in DeepSeek-V3's "
                                     "recipe, as the report runs them in FP8); BF16 without it"),
        ]
