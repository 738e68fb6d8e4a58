"""DeepSeek-V3 model args from a Hugging Face ``DeepseekV3ForCausalLM`` config.json of any size (DeepSeek-V3,
Moonlight, a DeepSeek-V2-Lite-shaped model with full-rank queries)."""
from __future__ import annotations

import dataclasses
from typing import Any

from models.common.attention.yarn import YarnScaling
from models.common.hf.fields import hf_field, hf_model_type
from models.common.hf.rope import rope_scaling_of
from models.deepseek_v3.args import DeepSeekV3ModelArgs
from models.deepseek_v3.state_dict_adapter import HF_ALIASES
from torchtitan_lite.components.checkpoint.hf_io import canonical_names
from torchtitan_lite.components.checkpoint.hf_rope import read_rope


def deepseek_v3_args_from_hf(config: dict[str, Any], base: DeepSeekV3ModelArgs) -> DeepSeekV3ModelArgs:
    """The file's architecture; ``base`` (a flavor) gives the balancing and init settings. Features the model
    has no form for (a softmax router, multi-token prediction layers, biases) are refused by the conversion's
    config check."""
    hf_model_type(config, "deepseek_v3", "DeepSeek-V3")
    config = canonical_names(config, HF_ALIASES)
    rope = read_rope(config)
    scaling = rope_scaling_of(rope, ("default", "yarn"))
    assert scaling is None or isinstance(scaling, YarnScaling)
    moe = dataclasses.replace(
        base.moe, num_experts=hf_field(config, "n_routed_experts"), top_k=hf_field(config, "num_experts_per_tok"),
        hidden_dim=hf_field(config, "moe_intermediate_size"), num_groups=hf_field(config, "n_group", 1),
        topk_groups=hf_field(config, "topk_group", 1), num_shared_experts=hf_field(config, "n_shared_experts"),
        route_scale=float(hf_field(config, "routed_scaling_factor")),
        norm_topk_prob=hf_field(config, "norm_topk_prob", True))
    return dataclasses.replace(
        base, dim=hf_field(config, "hidden_size"), n_layers=hf_field(config, "num_hidden_layers"),
        n_heads=hf_field(config, "num_attention_heads"), vocab_size=hf_field(config, "vocab_size"),
        q_lora_rank=hf_field(config, "q_lora_rank", 0),  # null: one full-rank query projection
        kv_lora_rank=hf_field(config, "kv_lora_rank"), qk_nope_head_dim=hf_field(config, "qk_nope_head_dim"),
        qk_rope_head_dim=hf_field(config, "qk_rope_head_dim"), v_head_dim=hf_field(config, "v_head_dim"),
        n_dense_layers=hf_field(config, "first_k_dense_replace"), dense_hidden_dim=hf_field(config, "intermediate_size"),
        norm_eps=hf_field(config, "rms_norm_eps"), rope_theta=rope["rope_theta"], rope_scaling=scaling,
        max_seq_len=hf_field(config, "max_position_embeddings"),
        tie_word_embeddings=hf_field(config, "tie_word_embeddings", False), moe=moe)
