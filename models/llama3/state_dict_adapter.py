"""Hugging Face `LlamaForCausalLM` <-> our state-dict names, and the matching config.json.

The rows of wq and wk are permuted per head between our rotary layout and HF's (models/common/hf/rotary.py).
"""
from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from models.common.hf import names as hf_names
from models.common.hf.config import attention_fields, with_token_ids
from models.common.hf.rotary import permute_from_hf, permute_to_hf
from models.llama3.args import Llama3ModelArgs

__all__ = ["Llama3StateDictAdapter", "hf_config_dict", "permute_from_hf", "permute_to_hf"]

_PER_LAYER = {
    **hf_names.ATTENTION,
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    **hf_names.BLOCK_NORMS,
}
# Buffers that older transformers versions saved next to the weights; they carry no learned state.
_HF_IGNORED_KEY = re.compile(r"^model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq$")


def hf_config_dict(args: Llama3ModelArgs, *, torch_dtype: str = "bfloat16", bos_token_id: int | None = None,
                   eos_token_id: int | None = None) -> dict[str, Any]:
    """config.json content for `LlamaForCausalLM`; token ids are written only when given."""
    rope_scaling = None
    if args.rope_scaling is not None:
        s = args.rope_scaling
        rope_scaling = {
            "rope_type": "llama3",
            "factor": s.factor,
            "low_freq_factor": s.low_freq_factor,
            "high_freq_factor": s.high_freq_factor,
            "original_max_position_embeddings": s.original_max_position_embeddings,
        }
    config: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": args.dim,
        "intermediate_size": args.ffn_hidden_dim,
        **attention_fields(args),
        "rope_scaling": rope_scaling,
        "vocab_size": args.vocab_size,
        "tie_word_embeddings": args.tie_word_embeddings,
        "max_position_embeddings": args.max_seq_len,
        "attention_bias": False,
        "mlp_bias": False,
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "pretraining_tp": 1,
        "use_cache": True,
        "torch_dtype": torch_dtype,
    }
    return with_token_ids(config, bos_token_id, eos_token_id)


class Llama3StateDictAdapter:
    """Renames (and re-permutes q/k rows) between our full state dict and HF's. Tensors must be whole:
    gather DTensor-sharded state (e.g. get_model_state_dict with full_state_dict=True) before converting."""

    def __init__(self, args: Llama3ModelArgs) -> None:
        self.args = args

    def hf_config_dict(self, **kwargs: Any) -> dict[str, Any]:
        """hf_config_dict(self.args, **kwargs)."""
        return hf_config_dict(self.args, **kwargs)

    # -- names and shapes ----------------------------------------------------------------------------

    def our_keys(self) -> list[str]:
        """Every key of Transformer(args).state_dict(), tied output included."""
        return hf_names.decoder_keys(self.args.n_layers, _PER_LAYER)

    def to_hf_key(self, key: str) -> str:
        if key in hf_names.TOP_LEVEL:
            return hf_names.TOP_LEVEL[key]
        m = hf_names.OUR_LAYER_KEY.match(key)
        if m and m.group(2) in _PER_LAYER and int(m.group(1)) < self.args.n_layers:
            return f"model.layers.{m.group(1)}.{_PER_LAYER[m.group(2)]}"
        raise KeyError(f"no Hugging Face name for {key!r}: not a Llama 3 weight of a {self.args.n_layers}-layer model")

    def from_hf_key(self, hf_key: str) -> str:
        for ours, theirs in hf_names.TOP_LEVEL.items():
            if hf_key == theirs:
                return ours
        m = hf_names.HF_LAYER_KEY.match(hf_key)
        if m and int(m.group(1)) < self.args.n_layers:
            for ours, theirs in _PER_LAYER.items():
                if m.group(2) == theirs:
                    return f"layers.{m.group(1)}.{ours}"
        raise KeyError(
            f"unexpected Hugging Face key {hf_key!r} for a {self.args.n_layers}-layer Llama 3 model; "
            "check that the checkpoint matches the flavor (n_layers, tied embeddings)"
        )

    def _expected_shape(self, key: str) -> tuple[int, ...]:
        a = self.args
        return {
            **hf_names.decoder_shapes(a),
            "feed_forward.w1.weight": (a.ffn_hidden_dim, a.dim),
            "feed_forward.w2.weight": (a.dim, a.ffn_hidden_dim),
            "feed_forward.w3.weight": (a.ffn_hidden_dim, a.dim),
        }[hf_names.block_name(key)]

    def _checked(self, key: str, tensor: torch.Tensor, shown_as: str) -> torch.Tensor:
        return hf_names.check_shape(tensor, self._expected_shape(key), shown_as)

    def _permute(self, key: str, tensor: torch.Tensor, fn: Callable[[torch.Tensor, int], torch.Tensor]) -> torch.Tensor:
        if key.endswith(("attention.wq.weight", "attention.wk.weight")):
            if isinstance(tensor, DTensor):
                raise TypeError(f"{key} is a DTensor: its rows must be whole to be permuted; gather a full state dict first")
            n_heads = self.args.n_heads if key.endswith("wq.weight") else self.args.kv_heads
            return fn(tensor, n_heads)
        return tensor

    # -- conversions -----------------------------------------------------------------------------------

    def to_hf(self, state_dict: dict[str, torch.Tensor], *, strict: bool = True) -> dict[str, torch.Tensor]:
        """Our names -> HF names. A tied model writes no lm_head.weight (HF re-ties it from embed_tokens)."""
        if strict:
            expected = [k for k in self.our_keys() if not (self.args.tie_word_embeddings and k == "output.weight")]
            hf_names.check_complete(set(state_dict), expected, "state dict")
        hf: dict[str, torch.Tensor] = {}
        for key, tensor in state_dict.items():
            hf_key = self.to_hf_key(key)
            if key == "output.weight" and self.args.tie_word_embeddings:
                continue
            hf[hf_key] = self._permute(key, self._checked(key, tensor, key), permute_to_hf)
        return hf

    def from_hf(self, hf_state_dict: dict[str, torch.Tensor], *, strict: bool = True) -> dict[str, torch.Tensor]:
        """HF names -> ours. With tied embeddings both tok_embeddings.weight and output.weight map to the
        embedding tensor (Transformer.state_dict() lists both); a saved lm_head.weight must then equal it."""
        tied = self.args.tie_word_embeddings
        ours: dict[str, torch.Tensor] = {}
        lm_head = None
        for hf_key, tensor in hf_state_dict.items():
            if _HF_IGNORED_KEY.match(hf_key):
                continue
            key = self.from_hf_key(hf_key)
            if key == "output.weight" and tied:
                lm_head = tensor
                continue
            ours[key] = self._permute(key, self._checked(key, tensor, hf_key), permute_from_hf)
        if tied:
            hf_names.tie_output(ours, lm_head)
        if strict:
            hf_names.check_complete(set(ours), self.our_keys(), "Hugging Face state dict", show=self.to_hf_key)
        return ours
