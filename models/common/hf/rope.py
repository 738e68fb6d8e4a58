"""Our rotary scaling objects from the normal form of a Hugging Face config.json's rotary settings
(torchtitan_lite/components/checkpoint/hf_rope.py reads both forms transformers writes)."""
from __future__ import annotations

from typing import Any

from models.common.attention.rope_scaling import RopeScaling
from models.common.attention.yarn import YarnScaling
from torchtitan_lite.components.checkpoint.hf_rope import RopeError


def rope_scaling_of(rope: dict[str, Any], supported: tuple[str, ...]) -> RopeScaling | YarnScaling | None:
    """Our scaling object for normal form ``rope`` (None for plain RoPE); refuses a rope_type outside ``supported``
    and settings our rotary table does not compute."""
    kind = rope["rope_type"]
    if kind not in supported:
        raise RopeError(f"rope_type={kind!r} is not supported by this model family (it builds "
                        f"{' or '.join(repr(s) for s in supported)})")
    if rope["partial_rotary_factor"] != 1.0:
        raise RopeError(f"partial_rotary_factor={rope['partial_rotary_factor']!r} is not supported (the rotary "
                        "embedding covers every channel of the rotary part)")
    if kind == "default":
        return None
    if kind == "llama3":
        return RopeScaling(factor=rope["factor"], low_freq_factor=rope["low_freq_factor"],
                           high_freq_factor=rope["high_freq_factor"],
                           original_max_position_embeddings=rope["original_max_position_embeddings"])
    if not rope["truncate"]:
        raise RopeError("yarn truncate=false is not supported (the correction range is truncated, as DeepSeek-V3's)")
    scaling = YarnScaling(factor=rope["factor"], original_max_position_embeddings=rope["original_max_position_embeddings"],
                          beta_fast=rope["beta_fast"], beta_slow=rope["beta_slow"], mscale=rope["mscale"],
                          mscale_all_dim=rope["mscale_all_dim"])
    if rope["attention_factor"] is not None and rope["attention_factor"] != scaling.attention_factor:
        raise RopeError(f"yarn attention_factor={rope['attention_factor']!r} differs from the one its factor and "
                        f"mscale give ({scaling.attention_factor!r}); an explicit attention factor is not supported")
    return scaling
