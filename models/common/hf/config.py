"""config.json fields every decoder family writes the same way for Hugging Face."""
from __future__ import annotations

from typing import Any

from models.common.decoder_args import DecoderArgs


def attention_fields(args: DecoderArgs) -> dict[str, Any]:
    """Head counts, depth, activation, norm epsilon and rotary base, under HF's names."""
    return {
        "num_attention_heads": args.n_heads,
        "num_key_value_heads": args.kv_heads,
        "num_hidden_layers": args.n_layers,
        "head_dim": args.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": args.norm_eps,
        "rope_theta": args.rope_theta,
    }


def with_token_ids(config: dict[str, Any], bos_token_id: int | None, eos_token_id: int | None) -> dict[str, Any]:
    """`config` with the token ids written in, only those given."""
    if bos_token_id is not None:
        config["bos_token_id"] = bos_token_id
    if eos_token_id is not None:
        config["eos_token_id"] = eos_token_id
    return config
