"""Hugging Face `Qwen3MoeForCausalLM` <-> our state-dict names, and the matching config.json.

The conversion is models/common/hf/moe_adapter.py's; experts: models/common/hf/experts.py (``to_hf`` writes
HF's per-expert layout, which every transformers version and serving stack reads; ``from_hf`` also accepts
transformers 5's fused in-memory layout, so a live model's ``state_dict()`` converts too). Qwen3-MoE balances
with an auxiliary loss: HF's model has no expert bias, so ours must be zero to export and is zero on import.

Rotary layout: as for Llama 3 (models/common/hf/rotary.py), our rotary pairs channels (2i, 2i+1)
and HF's pairs i with i + head_dim / 2, so the rows of wq / wk are permuted per head. Qwen3 normalises q
and k per head *before* the rotary embedding, so the q_norm / k_norm weights (one per head channel) get
the same permutation; the RMS itself does not depend on the channel order.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from models.common.hf import names as hf_names
from models.common.hf.config import attention_fields, with_token_ids
from models.common.hf.experts import EXPERT_WEIGHTS
from models.common.hf.moe_adapter import EXPERT_BIAS, MoEStateDictAdapter
from models.common.hf.rotary import permute_from_hf, permute_to_hf
from models.qwen3_moe.args import Qwen3MoeModelArgs

_PER_LAYER = {
    **hf_names.ATTENTION,
    "attention.q_norm.weight": "self_attn.q_norm.weight",
    "attention.k_norm.weight": "self_attn.k_norm.weight",
    **hf_names.BLOCK_NORMS,
    "moe.router.gate.weight": "mlp.gate.weight",
}
"""Block-relative renames; the routed experts are shared MoE logic, and the expert bias has no HF form."""
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


class Qwen3MoeStateDictAdapter(MoEStateDictAdapter[Qwen3MoeModelArgs]):
    """Renames, splits / stacks experts and re-permutes q/k between our full state dict and HF's. Tensors must
    be whole: gather DTensor-sharded state (get_model_state_dict with full_state_dict=True) first."""

    family = "Qwen3-MoE"
    hf_class = "Qwen3MoeForCausalLM"
    hf_router = "a softmax router without route scale or shared experts"
    per_layer = _PER_LAYER
    hf_aliases = HF_ALIASES
    hf_unused_keys = ("intermediate_size",)
    """config.json fields transformers reads only for what this model never has: intermediate_size sizes the dense
    MLP of the layers in mlp_only_layers (compared: none), so a file may hold any value."""

    def _hf_requires(self) -> tuple[tuple[str, object, object], ...]:
        m = self.args.moe
        return (("score_func", m.score_func, "softmax"), ("route_scale", m.route_scale, 1.0),
                ("num_shared_experts", m.num_shared_experts, 0))

    def _hf_config(self, **kwargs: Any) -> dict[str, Any]:
        return hf_config_dict(self.args, **kwargs)

    def _block_names(self, layer: int) -> list[str]:
        return [*_PER_LAYER, *EXPERT_WEIGHTS, EXPERT_BIAS]

    def _shapes(self) -> dict[str, tuple[int, ...]]:
        a = self.args
        return {
            **hf_names.decoder_shapes(a),
            "attention.q_norm.weight": (a.head_dim,),
            "attention.k_norm.weight": (a.head_dim,),
            **self._moe_shapes(),
        }

    def _to_hf_tensor(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        return self._permute(name, tensor, permute_to_hf)

    def _from_hf_tensor(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        return self._permute(name, tensor, permute_from_hf)

    def _permute(self, name: str, tensor: torch.Tensor, fn: Callable[[torch.Tensor, int], torch.Tensor]) -> torch.Tensor:
        a = self.args
        if name in ("attention.wq.weight", "attention.wk.weight"):
            return fn(tensor, a.n_heads if name == "attention.wq.weight" else a.n_kv_heads)
        if name in ("attention.q_norm.weight", "attention.k_norm.weight"):
            return fn(tensor.view(a.head_dim, 1), 1).view(a.head_dim)
        return tensor
