"""Hugging Face `DeepseekV3ForCausalLM` <-> our state-dict names, and the matching config.json.

Rotary layout: our rotary pairs channels (2i, 2i+1), which is DeepSeek's own checkpoint layout and what
transformers computes with ``rope_interleave: true`` (written to config.json), so no row is permuted.
The conversion is models/common/hf/moe_adapter.py's; experts: models/common/hf/experts.py (per-expert layout
written, transformers 5's fused layout read too).
The expert bias is HF's ``mlp.gate.e_score_correction_bias``: it decides the experts at inference as it
did in training. Multi-token prediction modules are neither written nor read.
"""
from __future__ import annotations

from typing import Any

from models.common.hf import names as hf_names
from models.common.hf.config import with_token_ids
from models.common.hf.experts import EXPERT_WEIGHTS
from models.common.hf.moe_adapter import EXPERT_BIAS, MoEStateDictAdapter
from models.deepseek_v3.args import DeepSeekV3ModelArgs

_ATTENTION = {
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wq_a.weight": "self_attn.q_a_proj.weight",
    "attention.q_norm.weight": "self_attn.q_a_layernorm.weight",
    "attention.wq_b.weight": "self_attn.q_b_proj.weight",
    "attention.wkv_a.weight": "self_attn.kv_a_proj_with_mqa.weight",
    "attention.kv_norm.weight": "self_attn.kv_a_layernorm.weight",
    "attention.wkv_b.weight": "self_attn.kv_b_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
}
_DENSE = {
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
}
_MOE = {
    "moe.router.gate.weight": "mlp.gate.weight",
    EXPERT_BIAS: "mlp.gate.e_score_correction_bias",
    "moe.shared_experts.w1.weight": "mlp.shared_experts.gate_proj.weight",
    "moe.shared_experts.w2.weight": "mlp.shared_experts.down_proj.weight",
    "moe.shared_experts.w3.weight": "mlp.shared_experts.up_proj.weight",
}
_ALL = {**_ATTENTION, **hf_names.BLOCK_NORMS, **_DENSE, **_MOE}
"""Block-relative renames of every block weight but the routed experts (shared MoE logic)."""
HF_ALIASES = {"num_local_experts": "n_routed_experts", "num_mtp_layers": "num_nextn_predict_layers"}
"""Other config.json names transformers reads for the fields this adapter writes."""


def hf_config_dict(args: DeepSeekV3ModelArgs, *, torch_dtype: str = "bfloat16", bos_token_id: int | None = None,
                   eos_token_id: int | None = None) -> dict[str, Any]:
    """config.json content for `DeepseekV3ForCausalLM`; token ids are written only when given."""
    m = args.moe
    config: dict[str, Any] = {
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "deepseek_v3",
        "hidden_size": args.dim,
        "intermediate_size": args.dense_hidden_dim,
        "moe_intermediate_size": m.hidden_dim,
        "num_hidden_layers": args.n_layers,
        "num_attention_heads": args.n_heads,
        "num_key_value_heads": args.n_heads,
        "q_lora_rank": args.q_lora_rank or None,
        "kv_lora_rank": args.kv_lora_rank,
        "qk_nope_head_dim": args.qk_nope_head_dim,
        "qk_rope_head_dim": args.qk_rope_head_dim,
        "v_head_dim": args.v_head_dim,
        "n_routed_experts": m.num_experts,
        "num_experts_per_tok": m.top_k,
        "n_shared_experts": m.num_shared_experts,
        "n_group": m.num_groups,
        "topk_group": m.topk_groups,
        "routed_scaling_factor": m.route_scale,
        "norm_topk_prob": m.norm_topk_prob,
        "scoring_func": "sigmoid",
        "topk_method": "noaux_tc",
        "first_k_dense_replace": args.n_dense_layers,
        "num_nextn_predict_layers": 0,
        "hidden_act": "silu",
        "rms_norm_eps": args.norm_eps,
        "rope_theta": args.rope_theta,
        "rope_scaling": args.rope_scaling.hf_dict() if args.rope_scaling is not None else None,
        "rope_interleave": True,
        "max_position_embeddings": args.max_seq_len,
        "vocab_size": args.vocab_size,
        "tie_word_embeddings": args.tie_word_embeddings,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "use_cache": True,
        "torch_dtype": torch_dtype,
    }
    return with_token_ids(config, bos_token_id, eos_token_id)


class DeepSeekV3StateDictAdapter(MoEStateDictAdapter[DeepSeekV3ModelArgs]):
    """Renames and splits / stacks experts between our full state dict and HF's. Tensors must be whole: gather
    DTensor-sharded state (get_model_state_dict with full_state_dict=True) first."""

    family = "DeepSeek-V3"
    hf_class = "DeepseekV3ForCausalLM"
    hf_router = "a sigmoid router and shared experts"
    per_layer = _ALL
    layer_hint = " (multi-token prediction layers are not read)"
    float32_suffixes = ("moe.expert_bias", "mlp.gate.e_score_correction_bias")
    """Exported in float32 whatever the weights' dtype (hf_io.export_dtype): the bias moves in 1e-3 steps around
    values a bfloat16 would round by ~1e-5, which could flip near-tied expert choices."""

    hf_aliases = HF_ALIASES
    hf_unused_keys = ("num_nextn_predict_layers",)
    """config.json fields that do not change the model's logits: the multi-token prediction layers are extra heads
    (transformers builds none, and writes 1 by default); their weights, where a checkpoint has them, are refused."""

    def _hf_requires(self) -> tuple[tuple[str, object, object], ...]:
        m = self.args.moe
        return (("score_func", m.score_func, "sigmoid"), ("num_shared_experts > 0", m.num_shared_experts > 0, True))

    def _hf_config(self, **kwargs: Any) -> dict[str, Any]:
        return hf_config_dict(self.args, **kwargs)

    def _block_names(self, layer: int) -> list[str]:
        """A dense block's names or an MoE block's; the query projection full-rank or low-rank (q_lora_rank)."""
        a = self.args
        q = ["attention.wq.weight"] if a.q_lora_rank == 0 else [
            "attention.wq_a.weight", "attention.q_norm.weight", "attention.wq_b.weight"]
        attention = [*q, "attention.wkv_a.weight", "attention.kv_norm.weight", "attention.wkv_b.weight",
                     "attention.wo.weight", "attention_norm.weight"]
        if layer < a.n_dense_layers:
            return [*attention, *_DENSE, "ffn_norm.weight"]
        moe = ["moe.router.gate.weight", *EXPERT_WEIGHTS]
        return [*attention, *moe, *[k for k in _MOE if k.startswith("moe.shared")], "ffn_norm.weight", EXPERT_BIAS]

    def _shapes(self) -> dict[str, tuple[int, ...]]:
        a = self.args
        h = a.n_heads
        return {
            "tok_embeddings.weight": (a.vocab_size, a.dim),
            "output.weight": (a.vocab_size, a.dim),
            "norm.weight": (a.dim,),
            "attention.wq.weight": (h * a.head_dim, a.dim),
            "attention.wq_a.weight": (a.q_lora_rank, a.dim),
            "attention.q_norm.weight": (a.q_lora_rank,),
            "attention.wq_b.weight": (h * a.head_dim, a.q_lora_rank),
            "attention.wkv_a.weight": (a.kv_lora_rank + a.qk_rope_head_dim, a.dim),
            "attention.kv_norm.weight": (a.kv_lora_rank,),
            "attention.wkv_b.weight": (h * (a.qk_nope_head_dim + a.v_head_dim), a.kv_lora_rank),
            "attention.wo.weight": (a.dim, h * a.v_head_dim),
            "attention_norm.weight": (a.dim,),
            "ffn_norm.weight": (a.dim,),
            "feed_forward.w1.weight": (a.dense_hidden_dim, a.dim),
            "feed_forward.w3.weight": (a.dense_hidden_dim, a.dim),
            "feed_forward.w2.weight": (a.dim, a.dense_hidden_dim),
            **self._moe_shapes(),
        }

    def _misplaced(self, key: str, shown_as: str, layer: int) -> Exception:
        kind = "dense" if layer < self.args.n_dense_layers else "MoE"
        return KeyError(f"{shown_as} does not belong in layer {layer}, a {kind} block of these model args "
                        f"(q_lora_rank={self.args.q_lora_rank}, n_dense_layers={self.args.n_dense_layers}); "
                        "check that the checkpoint matches the flavor")

    def _check_expert_layer(self, layer: int, hf_key: str) -> None:
        if layer < self.args.n_dense_layers:
            raise KeyError(f"{hf_key} is an expert weight, but layer {layer} is one of the first "
                           f"n_dense_layers={self.args.n_dense_layers} dense blocks of these model args; check "
                           "that the checkpoint matches the flavor")
