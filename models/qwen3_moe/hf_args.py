"""Qwen3-MoE model args from a Hugging Face ``Qwen3MoeForCausalLM`` config.json of any size."""
from __future__ import annotations

import dataclasses
from typing import Any

from models.common.hf.fields import hf_field, hf_model_type
from models.common.hf.rope import rope_scaling_of
from models.qwen3_moe.args import Qwen3MoeModelArgs
from models.qwen3_moe.state_dict_adapter import HF_ALIASES
from torchtitan_lite.components.checkpoint.hf_io import canonical_names
from torchtitan_lite.components.checkpoint.hf_rope import read_rope


def qwen3_moe_args_from_hf(config: dict[str, Any], base: Qwen3MoeModelArgs) -> Qwen3MoeModelArgs:
    """The file's architecture; ``base`` (a flavor) gives the balancing and init settings. Features the model
    has no form for (a dense MLP layer, sliding windows, biases) are refused by the conversion's config check."""
    hf_model_type(config, "qwen3_moe", "Qwen3-MoE")
    config = canonical_names(config, HF_ALIASES)
    rope = read_rope(config)
    rope_scaling_of(rope, ("default",))  # Qwen3-MoE's rotary table has no scaling
    dim, n_heads = hf_field(config, "hidden_size"), hf_field(config, "num_attention_heads")
    moe = dataclasses.replace(
        base.moe, num_experts=hf_field(config, "num_experts"), top_k=hf_field(config, "num_experts_per_tok"),
        hidden_dim=hf_field(config, "moe_intermediate_size"), norm_topk_prob=hf_field(config, "norm_topk_prob", False))
    return dataclasses.replace(
        base, dim=dim, n_layers=hf_field(config, "num_hidden_layers"), n_heads=n_heads,
        n_kv_heads=hf_field(config, "num_key_value_heads"),
        head_dim=hf_field(config, "head_dim", dim // n_heads),  # transformers' own default
        vocab_size=hf_field(config, "vocab_size"), norm_eps=hf_field(config, "rms_norm_eps"),
        rope_theta=rope["rope_theta"], max_seq_len=hf_field(config, "max_position_embeddings"),
        tie_word_embeddings=hf_field(config, "tie_word_embeddings", False), moe=moe)
