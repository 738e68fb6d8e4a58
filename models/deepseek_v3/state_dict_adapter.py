"""Hugging Face `DeepseekV3ForCausalLM` <-> our state-dict names, and the matching config.json.

Rotary layout: our rotary pairs channels (2i, 2i+1), which is DeepSeek's own checkpoint layout and what
transformers computes with ``rope_interleave: true`` (written to config.json), so no row is permuted.
Experts: models/common/hf_experts.py (per-expert layout written, transformers 5's fused layout read too).
The expert bias is HF's ``mlp.gate.e_score_correction_bias``: it decides the experts at inference as it
did in training. Multi-token prediction modules are neither written nor read.
"""
from __future__ import annotations

import re
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from models.common import hf_names
from models.common.hf_config import with_token_ids
from models.common.hf_experts import (
    EXPERT_WEIGHTS,
    HF_EXPERT_KEY,
    HF_FUSED,
    PerExpertCollector,
    experts_to_hf,
    split_fused,
)
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
    "moe.expert_bias": "mlp.gate.e_score_correction_bias",
    "moe.shared_experts.w1.weight": "mlp.shared_experts.gate_proj.weight",
    "moe.shared_experts.w2.weight": "mlp.shared_experts.down_proj.weight",
    "moe.shared_experts.w3.weight": "mlp.shared_experts.up_proj.weight",
}
_ALL = {**_ATTENTION, **hf_names.BLOCK_NORMS, **_DENSE, **_MOE}
_FROM_HF = {hf: ours for ours, hf in _ALL.items()}
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


class DeepSeekV3StateDictAdapter:
    """Renames and splits / stacks experts between our full state dict and HF's. Tensors must be whole: gather
    DTensor-sharded state (get_model_state_dict with full_state_dict=True) first."""

    float32_suffixes = ("moe.expert_bias", "mlp.gate.e_score_correction_bias")
    """Exported in float32 whatever the weights' dtype (hf_io.export_dtype): the bias moves in 1e-3 steps around
    values a bfloat16 would round by ~1e-5, which could flip near-tied expert choices."""

    hf_aliases = HF_ALIASES
    hf_unused_keys = ("num_nextn_predict_layers",)
    """config.json fields that do not change the model's logits: the multi-token prediction layers are extra heads
    (transformers builds none, and writes 1 by default); their weights, where a checkpoint has them, are refused."""

    def __init__(self, args: DeepSeekV3ModelArgs) -> None:
        self.args = args

    def _check_representable(self) -> None:
        m = self.args.moe
        unsupported = [f"{name}={value!r}" for name, value, hf in (
            ("score_func", m.score_func, "sigmoid"), ("num_shared_experts > 0", m.num_shared_experts > 0, True))
            if value != hf]
        if unsupported:
            raise ValueError(f"DeepseekV3ForCausalLM has a sigmoid router and shared experts, but these model args "
                             f"set {', '.join(unsupported)}; such a model has no Hugging Face DeepSeek-V3 form")

    def hf_config_dict(self, **kwargs: Any) -> dict[str, Any]:
        self._check_representable()
        return hf_config_dict(self.args, **kwargs)

    # -- names and shapes ----------------------------------------------------------------------------

    def _block_names(self, layer: int) -> list[str]:
        a = self.args
        q = ["attention.wq.weight"] if a.q_lora_rank == 0 else [
            "attention.wq_a.weight", "attention.q_norm.weight", "attention.wq_b.weight"]
        attention = [*q, "attention.wkv_a.weight", "attention.kv_norm.weight", "attention.wkv_b.weight",
                     "attention.wo.weight", "attention_norm.weight"]
        if layer < a.n_dense_layers:
            return [*attention, *_DENSE, "ffn_norm.weight"]
        moe = ["moe.router.gate.weight", *EXPERT_WEIGHTS]
        return [*attention, *moe, *[k for k in _MOE if k.startswith("moe.shared")], "ffn_norm.weight",
                "moe.expert_bias"]

    def our_keys(self) -> list[str]:
        """Every key of DeepSeekV3Model(args).state_dict(), tied output included (as a set, not in module order)."""
        keys = ["tok_embeddings.weight"]
        for i in range(self.args.n_layers):
            keys += [f"layers.{i}.{name}" for name in self._block_names(i)]
        return keys + ["norm.weight", "output.weight"]

    def _expected_shape(self, key: str) -> tuple[int, ...]:
        a, m = self.args, self.args.moe
        h, shared = a.n_heads, m.num_shared_experts * m.hidden_dim
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
            "moe.router.gate.weight": (m.num_experts, a.dim),
            "moe.expert_bias": (m.num_experts,),
            "moe.experts.w1": (m.num_experts, m.hidden_dim, a.dim),
            "moe.experts.w3": (m.num_experts, m.hidden_dim, a.dim),
            "moe.experts.w2": (m.num_experts, a.dim, m.hidden_dim),
            "moe.shared_experts.w1.weight": (shared, a.dim),
            "moe.shared_experts.w3.weight": (shared, a.dim),
            "moe.shared_experts.w2.weight": (a.dim, shared),
        }[hf_names.block_name(key)]

    def _checked(self, key: str, tensor: torch.Tensor, shown_as: str) -> torch.Tensor:
        if isinstance(tensor, DTensor):
            raise TypeError(f"{shown_as} is a DTensor: gather a full state dict before converting")
        layer = hf_names.OUR_LAYER_KEY.match(key)
        if layer is not None and hf_names.block_name(key) not in self._block_names(int(layer.group(1))):
            kind = "dense" if int(layer.group(1)) < self.args.n_dense_layers else "MoE"
            raise KeyError(f"{shown_as} does not belong in layer {layer.group(1)}, a {kind} block of these model args "
                           f"(q_lora_rank={self.args.q_lora_rank}, n_dense_layers={self.args.n_dense_layers}); "
                           "check that the checkpoint matches the flavor")
        return hf_names.check_shape(tensor, self._expected_shape(key), shown_as)

    def _layer(self, match: re.Match[str] | None, key: str, kind: str) -> tuple[int, str]:
        if match is None or int(match.group(1)) >= self.args.n_layers:
            raise KeyError(f"unexpected {kind} key {key!r} for a {self.args.n_layers}-layer DeepSeek-V3 model; "
                           "check that the checkpoint matches the flavor (multi-token prediction layers are not read)")
        return int(match.group(1)), match.group(2)

    # -- conversions -----------------------------------------------------------------------------------

    def to_hf(self, state_dict: dict[str, torch.Tensor], *, strict: bool = True) -> dict[str, torch.Tensor]:
        """Our names -> HF's per-expert checkpoint layout. A tied model writes no lm_head.weight."""
        self._check_representable()
        tied = self.args.tie_word_embeddings
        if strict:
            expected = [k for k in self.our_keys() if not (tied and k == "output.weight")]
            hf_names.check_complete(set(state_dict), expected, "state dict", names=" (our names)")
        hf: dict[str, torch.Tensor] = {}
        for key, tensor in state_dict.items():
            if key in hf_names.TOP_LEVEL:
                if not (tied and key == "output.weight"):
                    hf[hf_names.TOP_LEVEL[key]] = self._checked(key, tensor, key)
                continue
            i, name = self._layer(hf_names.OUR_LAYER_KEY.match(key), key, "state dict")
            tensor = self._checked(key, tensor, key)
            prefix = f"model.layers.{i}."
            if name in EXPERT_WEIGHTS:
                hf.update(experts_to_hf(prefix, name, tensor))
            else:
                hf[prefix + _ALL[name]] = tensor
        return hf

    def from_hf(self, hf_state_dict: dict[str, torch.Tensor], *, strict: bool = True) -> dict[str, torch.Tensor]:
        """HF names (per-expert or transformers 5's fused experts) -> ours. With tied embeddings output.weight
        maps to the embedding tensor; a saved lm_head.weight must equal it."""
        self._check_representable()
        tied = self.args.tie_word_embeddings
        ours: dict[str, torch.Tensor] = {}
        experts = PerExpertCollector(self.args.moe.num_experts)
        lm_head = None
        for hf_key, tensor in hf_state_dict.items():
            top = next((k for k, v in hf_names.TOP_LEVEL.items() if v == hf_key), None)
            if top is not None:
                if top == "output.weight" and tied:
                    lm_head = tensor
                else:
                    ours[top] = self._checked(top, tensor, hf_key)
                continue
            i, name = self._layer(hf_names.HF_LAYER_KEY.match(hf_key), hf_key, "Hugging Face")
            prefix = f"layers.{i}."
            expert = HF_EXPERT_KEY.match(name)
            if name in _FROM_HF:
                ours[prefix + _FROM_HF[name]] = self._checked(prefix + _FROM_HF[name], tensor, hf_key)
            elif expert is not None:
                if i < self.args.n_dense_layers:
                    raise KeyError(f"{hf_key} is an expert weight, but layer {i} is one of the first "
                                   f"n_dense_layers={self.args.n_dense_layers} dense blocks of these model args; check "
                                   "that the checkpoint matches the flavor")
                experts.add(i, expert, tensor)
            elif name in HF_FUSED:
                for part, value in split_fused(name, tensor, self.args.moe.hidden_dim, hf_key).items():
                    ours[prefix + part] = self._checked(prefix + part, value, hf_key)
            else:
                raise KeyError(f"unexpected Hugging Face key {hf_key!r} for a DeepSeek-V3 model")
        for key, tensor in experts.stacked().items():
            ours[key] = self._checked(key, tensor, key)
        if tied:
            hf_names.tie_output(ours, lm_head)
        if strict:
            hf_names.check_complete(set(ours), self.our_keys(), "Hugging Face state dict", names=" (our names)")
        return ours
