"""The rotary settings of a Hugging Face ``config.json``, in either of the forms transformers writes.

transformers 4 writes a top-level ``rope_theta`` and ``rope_scaling`` (type under ``rope_type``, or under
``type`` in DeepSeek-V3's published file); transformers 5's ``save_pretrained`` writes one ``rope_parameters``
dict holding ``rope_type``, ``rope_theta`` and the scaling fields. Both are read into one normal form in which
every field that changes the rotary function (or, for YaRN, the softmax scale) is present, absent fields taking
the value transformers uses, so that two configs compare by what they compute.
"""
from __future__ import annotations

from typing import Any

ROPE_KEYS = ("rope_theta", "rope_scaling", "rope_parameters")
"""The config.json keys the rotary settings are read from (compared through ``read_rope``, not one by one)."""

_REQUIRED = object()
_MAX_POSITIONS = object()  # transformers takes config.max_position_embeddings

# Per rope_type, the fields of its function with transformers' value when absent.
_FIELDS: dict[str, dict[str, Any]] = {
    "default": {},
    "llama3": {"factor": _REQUIRED, "low_freq_factor": _REQUIRED, "high_freq_factor": _REQUIRED,
               "original_max_position_embeddings": _MAX_POSITIONS},
    # mscale / mscale_all_dim: absent reads as 0 (transformers then derives the table factor from `factor`
    # alone and DeepSeek-V3 leaves its softmax scale uncorrected); attention_factor: absent is derived.
    "yarn": {"factor": _REQUIRED, "original_max_position_embeddings": _MAX_POSITIONS, "beta_fast": 32.0,
             "beta_slow": 1.0, "mscale": 0.0, "mscale_all_dim": 0.0, "attention_factor": None, "truncate": True},
}
_COMMON = {"partial_rotary_factor": 1.0}


class RopeError(ValueError):
    """config.json's rotary settings cannot be read or are not supported."""


def read_rope(config: dict[str, Any]) -> dict[str, Any]:
    """The normal form of ``config``'s rotary settings: rope_type, rope_theta, partial_rotary_factor and the
    fields of that rope_type. Settings given in both forms must agree."""
    old = _old_form(config)
    new = config.get("rope_parameters")
    if new is not None:
        if not isinstance(new, dict) or not all(not isinstance(v, dict) for v in new.values()):
            raise RopeError(f"rope_parameters={new!r} is not one dict of rotary settings (per-layer-type rotary "
                            "settings are not supported)")
        new = _normal(new, config)
        if old is not None and _normal(old, config) != new:
            raise RopeError(f"the rotary settings in rope_parameters ({_show(new)}) and in rope_theta / rope_scaling "
                            f"({_show(_normal(old, config))}) disagree; keep one of them")
        return new
    if old is None:
        raise RopeError("config.json has neither rope_parameters nor rope_theta")
    return _normal(old, config)


def rope_difference(file: dict[str, Any], ours: dict[str, Any]) -> str | None:
    """None when the two normal forms compute the same rotary function, else the differing fields
    (``name=file's value (ours: value)``)."""
    if file == ours:
        return None
    keys = [k for k in {**file, **ours} if file.get(k) != ours.get(k)]
    return ", ".join(f"{k}={file.get(k)!r} (ours: {ours.get(k)!r})" for k in keys)


def _old_form(config: dict[str, Any]) -> dict[str, Any] | None:
    if config.get("rope_theta") is None and config.get("rope_scaling") is None:
        return None
    scaling = config.get("rope_scaling") or {}
    if not isinstance(scaling, dict):
        raise RopeError(f"rope_scaling={scaling!r} is not a dict")
    return {**scaling, "rope_theta": config.get("rope_theta")}


def _normal(params: dict[str, Any], config: dict[str, Any]) -> dict[str, Any]:
    kinds = {params[k] for k in ("rope_type", "type") if params.get(k) is not None}
    if len(kinds) > 1:
        raise RopeError(f"rope settings name two types, rope_type={params['rope_type']!r} and type={params['type']!r}")
    kind = kinds.pop() if kinds else "default"
    if kind not in _FIELDS:
        raise RopeError(f"rope_type={kind!r} is not supported (supported: {', '.join(_FIELDS)})")
    if params.get("rope_theta") is None:
        raise RopeError("the rotary settings have no rope_theta")
    normal: dict[str, Any] = {"rope_type": kind, "rope_theta": float(params["rope_theta"])}
    for name, default in {**_COMMON, **_FIELDS[kind]}.items():
        value = params.get(name, config.get(name) if name in _COMMON else None)
        if value is None and name == "factor" and kind == "yarn" and params.get("original_max_position_embeddings"):
            value = config["max_position_embeddings"] / params["original_max_position_embeddings"]  # as transformers
        if value is None:
            if default is _REQUIRED:
                raise RopeError(f"rope_type={kind!r} needs {name}, which config.json does not give")
            value = config.get("max_position_embeddings") if default is _MAX_POSITIONS else default
        normal[name] = value
    return normal


def _show(rope: dict[str, Any]) -> str:
    return ", ".join(f"{k}={v!r}" for k, v in rope.items())
