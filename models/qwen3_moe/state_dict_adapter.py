"""Hugging Face `Qwen3MoeForCausalLM` <-> our state-dict names, and the matching config.json.

Experts: models/common/hf_experts.py (``to_hf`` writes HF's per-expert layout, which every transformers
version and serving stack reads; ``from_hf`` also accepts transformers 5's fused in-memory layout, so a
live model's ``state_dict()`` converts too).

Rotary layout: as for Llama 3 (models/common/hf_rotary.py), our rotary pairs channels (2i, 2i+1)
and HF's pairs i with i + head_dim / 2, so the rows of wq / wk are permuted per head. Qwen3 normalises q
and k per head *before* the rotary embedding, so the q_norm / k_norm weights (one per head channel) get
the same permutation; the RMS itself does not depend on the channel order.
"""
from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from models.common import hf_names
from models.common.hf_config import attention_fields, with_token_ids
from models.common.hf_experts import (
    EXPERT_WEIGHTS,
    HF_EXPERT_KEY,
    HF_FUSED,
    PerExpertCollector,
    experts_to_hf,
    split_fused,
)
from models.common.hf_rotary import permute_from_hf, permute_to_hf
from models.qwen3_moe.args import Qwen3MoeModelArgs

_PER_LAYER = {
    **hf_names.ATTENTION,
    "attention.q_norm.weight": "self_attn.q_norm.weight",
    "attention.k_norm.weight": "self_attn.k_norm.weight",
    **hf_names.BLOCK_NORMS,
    "moe.router.gate.weight": "mlp.gate.weight",
}
_EXPERT_BIAS = "moe.expert_bias"
HF_ALIASES = {"num_local_experts": "num_experts"}
"""config.json names transformers 5 writes -> the names this adapter writes (both versions read either)."""


def hf_config_dict(args: Qwen3MoeModelArgs, *, torch_dtype: str = "bfloat16", bos_token_id: int | None = None,
                   eos_token_id: int | None = None) -> dict[str, Any]:
    """config.json content for `Qwen3MoeForCausalLM`; token ids are written only when given."""
    m = args.moe
    config: dict[str, Any] = {
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "hidden_size": args.dim,
        # Width of HF's dense MLP, used only by layers listed in mlp_only_layers (none here); the published
        # configs set it to top_k * moe_intermediate_size, as this does.
        "intermediate_size": m.active_hidden_dim,
        "moe_intermediate_size": m.hidden_dim,
        "num_experts": m.num_experts,
        "num_experts_per_tok": m.top_k,
        "norm_topk_prob": m.norm_topk_prob,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        **attention_fields(args),
        "rope_scaling": None,
        "vocab_size": args.vocab_size,
        "tie_word_embeddings": args.tie_word_embeddings,
        "max_position_embeddings": args.max_seq_len,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "use_sliding_window": False,
        "initializer_range": 0.02,
        "use_cache": True,
        "torch_dtype": torch_dtype,
    }
    return with_token_ids(config, bos_token_id, eos_token_id)


class Qwen3MoeStateDictAdapter:
    """Renames, splits / stacks experts and re-permutes q/k between our full state dict and HF's. Tensors must
    be whole: gather DTensor-sharded state (get_model_state_dict with full_state_dict=True) first."""

    hf_aliases = HF_ALIASES
    hf_unused_keys = ("intermediate_size",)
    """config.json fields transformers reads only for what this model never has: intermediate_size sizes the dense
    MLP of the layers in mlp_only_layers (compared: none), so a file may hold any value."""

    def __init__(self, args: Qwen3MoeModelArgs) -> None:
        self.args = args

    def _check_representable(self) -> None:
        m = self.args.moe
        unsupported = [f"{name}={value!r}" for name, value, hf in (
            ("score_func", m.score_func, "softmax"), ("route_scale", m.route_scale, 1.0),
            ("num_shared_experts", m.num_shared_experts, 0)) if value != hf]
        if unsupported:
            raise ValueError(f"Qwen3MoeForCausalLM has a softmax router without route scale or shared experts, "
                             f"but these model args set {', '.join(unsupported)}; such a model has no Hugging Face "
                             "Qwen3-MoE form")

    def hf_config_dict(self, **kwargs: Any) -> dict[str, Any]:
        self._check_representable()
        return hf_config_dict(self.args, **kwargs)

    # -- names and shapes ----------------------------------------------------------------------------

    def our_keys(self) -> list[str]:
        """Every key of Qwen3MoeModel(args).state_dict(), tied output included."""
        return hf_names.decoder_keys(self.args.n_layers, [*_PER_LAYER, *EXPERT_WEIGHTS, _EXPERT_BIAS])

    def _expected_shape(self, key: str) -> tuple[int, ...]:
        a, m = self.args, self.args.moe
        return {
            **hf_names.decoder_shapes(a),
            "attention.q_norm.weight": (a.head_dim,),
            "attention.k_norm.weight": (a.head_dim,),
            "moe.router.gate.weight": (m.num_experts, a.dim),
            "moe.experts.w1": (m.num_experts, m.hidden_dim, a.dim),
            "moe.experts.w3": (m.num_experts, m.hidden_dim, a.dim),
            "moe.experts.w2": (m.num_experts, a.dim, m.hidden_dim),
            _EXPERT_BIAS: (m.num_experts,),
        }[hf_names.block_name(key)]

    def _checked(self, key: str, tensor: torch.Tensor, shown_as: str) -> torch.Tensor:
        if isinstance(tensor, DTensor):
            raise TypeError(f"{shown_as} is a DTensor: gather a full state dict before converting")
        return hf_names.check_shape(tensor, self._expected_shape(key), shown_as)

    def _layer(self, match: re.Match[str] | None, key: str, kind: str) -> tuple[int, str]:
        if match is None or int(match.group(1)) >= self.args.n_layers:
            raise KeyError(f"unexpected {kind} key {key!r} for a {self.args.n_layers}-layer Qwen3-MoE model; "
                           "check that the checkpoint matches the flavor")
        return int(match.group(1)), match.group(2)

    def _permute(self, name: str, tensor: torch.Tensor, fn: Callable[[torch.Tensor, int], torch.Tensor]) -> torch.Tensor:
        a = self.args
        if name in ("attention.wq.weight", "attention.wk.weight"):
            return fn(tensor, a.n_heads if name == "attention.wq.weight" else a.n_kv_heads)
        if name in ("attention.q_norm.weight", "attention.k_norm.weight"):
            return fn(tensor.view(a.head_dim, 1), 1).view(a.head_dim)
        return tensor

    # -- conversions -----------------------------------------------------------------------------------

    def to_hf(self, state_dict: dict[str, torch.Tensor], *, strict: bool = True) -> dict[str, torch.Tensor]:
        """Our names -> HF's per-expert checkpoint layout. A tied model writes no lm_head.weight.

        The expert bias has no HF form: it must be zero (Qwen3-MoE balances with an auxiliary loss), else
        the export would change which experts the model picks."""
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
            tensor = self._checked(key, tensor, key) if name in (*_PER_LAYER, *EXPERT_WEIGHTS, _EXPERT_BIAS) else tensor
            prefix = f"model.layers.{i}."
            if name in _PER_LAYER:
                hf[prefix + _PER_LAYER[name]] = self._permute(name, tensor, permute_to_hf)
            elif name in EXPERT_WEIGHTS:
                hf.update(experts_to_hf(prefix, name, tensor))
            elif name == _EXPERT_BIAS:
                if bool(tensor.ne(0).any()):
                    raise ValueError(f"{key} is not zero: Hugging Face Qwen3-MoE has no expert bias, so the exported "
                                     "model would route differently; export a model trained with bias_update_rate=0")
            else:
                raise KeyError(f"no Hugging Face name for {key!r}: not a Qwen3-MoE weight")
        return hf

    def from_hf(self, hf_state_dict: dict[str, torch.Tensor], *, strict: bool = True) -> dict[str, torch.Tensor]:
        """HF names (per-expert or transformers 5's fused experts) -> ours; the expert bias is set to zero.
        With tied embeddings output.weight maps to the embedding tensor; a saved lm_head.weight must equal it."""
        self._check_representable()
        a, tied = self.args, self.args.tie_word_embeddings
        ours: dict[str, torch.Tensor] = {}
        experts = PerExpertCollector(a.moe.num_experts)
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
            ours_name = next((k for k, v in _PER_LAYER.items() if v == name), None)
            expert = HF_EXPERT_KEY.match(name)
            if ours_name is not None:
                ours[prefix + ours_name] = self._permute(
                    ours_name, self._checked(prefix + ours_name, tensor, hf_key), permute_from_hf)
            elif expert is not None:
                experts.add(i, expert, tensor)
            elif name in HF_FUSED:
                for ours_name, part in split_fused(name, tensor, a.moe.hidden_dim, hf_key).items():
                    ours[prefix + ours_name] = self._checked(prefix + ours_name, part, hf_key)
            else:
                raise KeyError(f"unexpected Hugging Face key {hf_key!r} for a Qwen3-MoE model")
        for key, tensor in experts.stacked().items():
            ours[key] = self._checked(key, tensor, key)
        for i in {int(k.split(".")[1]) for k in ours if k.startswith("layers.")}:
            ours[f"layers.{i}.{_EXPERT_BIAS}"] = torch.zeros(a.moe.num_experts, dtype=torch.float32)
        if tied:
            hf_names.tie_output(ours, lm_head)
        if strict:
            hf_names.check_complete(set(ours), self.our_keys(), "Hugging Face state dict", names=" (our names)")
        return ours
