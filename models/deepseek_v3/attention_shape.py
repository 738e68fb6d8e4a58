"""What context parallelism gathers of multi-head latent attention, and what its attention keeps (as data for the
core's memory estimate, protocols/attention_shape.py).

A block's keys and values are expanded by ``wkv_b`` from the normalised latent (kv_lora_rank channels) plus the
rotary key every head shares (qk_rope_head_dim): those 576 channels (671B) are what the CP group all-gathers, one
tensor on every TP rank, and each rank then expands its heads' K (qk_nope_head_dim + qk_rope_head_dim) and V
(v_head_dim) for the whole sequence, which attention saves.
"""
from __future__ import annotations

from models.deepseek_v3.args import DeepSeekV3ModelArgs
from torchtitan_lite.protocols.attention_shape import AttentionShape


def deepseek_v3_attention_shape(args: DeepSeekV3ModelArgs) -> AttentionShape:
    return AttentionShape(kv_width=args.n_heads * (args.qk_nope_head_dim + args.qk_rope_head_dim + args.v_head_dim),
                          latent_width=args.kv_lora_rank + args.qk_rope_head_dim)
