"""State-dict names shared by the decoder families' Hugging Face adapters, and the checks on them.

Every family keeps the Llama 3 module names (tok_embeddings, layers.<i>.attention / attention_norm /
ffn_norm, norm, output); HF's decoders share theirs (model.embed_tokens, model.layers.<i>.self_attn, ...).
"""
from __future__ import annotations

import re
from collections.abc import Callable, Iterable

import torch

from models.common.decoder_args import DecoderArgs

TOP_LEVEL = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
"""Our top-level keys -> HF's."""

ATTENTION = {
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
}
"""The attention projections of a block: our names under layers.<i>. -> HF's under model.layers.<i>.."""

BLOCK_NORMS = {
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}
"""The two pre-norms of a block: our names -> HF's."""

OUR_LAYER_KEY = re.compile(r"^layers\.(\d+)\.(.+)$")
HF_LAYER_KEY = re.compile(r"^model\.layers\.(\d+)\.(.+)$")


def decoder_keys(n_layers: int, per_layer: Iterable[str]) -> list[str]:
    """Every state-dict key of a decoder whose blocks hold `per_layer`, tied output included, in module order."""
    names = list(per_layer)
    keys = ["tok_embeddings.weight"]
    for i in range(n_layers):
        keys += [f"layers.{i}.{name}" for name in names]
    return keys + ["norm.weight", "output.weight"]


def block_name(key: str) -> str:
    """The name inside its block of a layers.<i>.<name> key; any other key unchanged."""
    layer_key = OUR_LAYER_KEY.match(key)
    return layer_key.group(2) if layer_key else key


def decoder_shapes(args: DecoderArgs) -> dict[str, tuple[int, ...]]:
    """Shapes of the top-level weights, the attention projections and the block norms (block names)."""
    a = args
    q_out, kv_out = a.n_heads * a.head_dim, a.kv_heads * a.head_dim
    return {
        "tok_embeddings.weight": (a.vocab_size, a.dim),
        "output.weight": (a.vocab_size, a.dim),
        "norm.weight": (a.dim,),
        "attention.wq.weight": (q_out, a.dim),
        "attention.wk.weight": (kv_out, a.dim),
        "attention.wv.weight": (kv_out, a.dim),
        "attention.wo.weight": (a.dim, q_out),
        "attention_norm.weight": (a.dim,),
        "ffn_norm.weight": (a.dim,),
    }


def check_shape(tensor: torch.Tensor, expected: tuple[int, ...], shown_as: str) -> torch.Tensor:
    """`tensor` when it has the `expected` shape; a ValueError naming `shown_as` otherwise."""
    if tuple(tensor.shape) != expected:
        raise ValueError(
            f"{shown_as} has shape {tuple(tensor.shape)}, expected {expected} for these model args; "
            "the checkpoint was saved from a different flavor"
        )
    return tensor


def check_complete(present: set[str], expected: list[str], what: str, *, show: Callable[[str], str] = lambda k: k,
                   names: str = "") -> None:
    """KeyError listing (up to five of) the `expected` keys missing from `present`, each as `show` writes it;
    `names` says which naming they are in (e.g. " (our names)")."""
    missing = [show(k) for k in expected if k not in present]
    if missing:
        shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        raise KeyError(f"{what} lacks {len(missing)} expected key(s){names}: {shown}; pass strict=False "
                       "for a partial dict")


def tie_output(ours: dict[str, torch.Tensor], lm_head: torch.Tensor | None) -> None:
    """For tied embeddings: point output.weight at the embedding tensor in `ours`, after checking that a saved
    lm_head.weight (None when absent) equals it."""
    if lm_head is not None and "tok_embeddings.weight" in ours and not torch.equal(lm_head, ours["tok_embeddings.weight"]):
        raise ValueError(
            "lm_head.weight differs from model.embed_tokens.weight but the model args tie them; "
            "use a flavor with tie_word_embeddings=False for this checkpoint"
        )
    if "tok_embeddings.weight" in ours:
        ours["output.weight"] = ours["tok_embeddings.weight"]
