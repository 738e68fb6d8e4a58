"""Reading a Hugging Face config.json's architecture fields for a family's ``args_from_hf``."""
from __future__ import annotations

from typing import Any

REQUIRED = object()


def hf_field(config: dict[str, Any], key: str, default: Any = REQUIRED) -> Any:
    """``config[key]``; ``default`` where the key is absent or null (the value transformers then takes), and a
    refusal naming the key where the model's shape needs it."""
    value = config.get(key)
    if value is not None:
        return value
    if default is REQUIRED:
        raise ValueError(f"config.json has no {key}, which the model's shape needs")
    return default


def hf_model_type(config: dict[str, Any], expected: str, family: str) -> None:
    """Refuses a config.json of another architecture than ``family``'s (HF model_type ``expected``)."""
    if config.get("model_type") != expected:
        raise ValueError(f"model_type={config.get('model_type')!r} is not a {family} model (model_type "
                         f"{expected!r}); pick a --config of the model's family")
