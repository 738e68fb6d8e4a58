"""Convert command-line text and TOML values to the type of a config field.

Command line: bool is true/false/yes/no/1/0 (any case); ``none``/``null`` is None for ``X | None``;
floats accept ``1e-3``; lists are ``a,b`` or ``[a, b]`` and the empty string is ``[]``.
TOML: values must already have the field's type; an int is accepted for a float field, a bool is
never accepted as a number, and the string ``"none"`` (or ``"null"``) is None for ``X | None``
because TOML has no null.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torchtitan_lite.config.errors import ConfigError, closest, did_you_mean
from torchtitan_lite.config.field_types import (
    NoneType,
    describe_type,
    list_item_type,
    literal_values,
    union_members,
)

TRUE_WORDS = frozenset({"true", "yes", "1"})
FALSE_WORDS = frozenset({"false", "no", "0"})
NONE_WORDS = frozenset({"none", "null"})


class _Mismatch(Exception):
    """The value does not fit the type; the caller words the error with the key."""


def from_cli_text(text: str, tp: Any, label: str) -> Any:
    """Convert the text given for ``label`` (e.g. ``--training.steps``) to type ``tp``."""
    try:
        return _from_text(text, tp)
    except _Mismatch:
        raise ConfigError(f"{label} expects {describe_type(tp)}, got {text!r}{_literal_hint(text, tp)}") from None


def from_toml_value(value: Any, tp: Any, label: str) -> Any:
    """Check (and, for int -> float, convert) a TOML value given for ``label`` against type ``tp``."""
    try:
        return _from_native(value, tp)
    except _Mismatch:
        hint = _literal_hint(value, tp) if isinstance(value, str) else ""
        raise ConfigError(
            f"{label} expects {describe_type(tp)}, got {value!r} ({type(value).__name__}){hint}"
        ) from None


def is_none_word(text: str) -> bool:
    """Whether text spells None (``none`` / ``null``, any case)."""
    return text.strip().lower() in NONE_WORDS


def split_list_text(text: str) -> list[str]:
    """``"a, b"`` / ``"[a, b]"`` / ``'["a", "b"]'`` -> ``["a", "b"]``; ``""`` and ``"[]"`` -> ``[]``."""
    text = text.strip()
    if text.startswith("[") and text.endswith("]"):
        text = text[1:-1].strip()
    if not text:
        return []
    return [_unquote(item.strip()) for item in text.split(",")]


def _unquote(item: str) -> str:
    if len(item) >= 2 and item[0] == item[-1] and item[0] in "\"'":
        return item[1:-1]
    return item


def _from_text(text: str, tp: Any) -> Any:
    if tp is bool:
        word = text.strip().lower()
        if word in TRUE_WORDS or word in FALSE_WORDS:
            return word in TRUE_WORDS
        raise _Mismatch
    if tp is int:
        return _call(int, text)
    if tp is float:
        return _call(float, text)
    if tp is str:
        return text
    if (values := literal_values(tp)) is not None:
        for allowed in values:
            if text == (str(allowed).lower() if isinstance(allowed, bool) else str(allowed)):
                return allowed
        raise _Mismatch
    if (members := union_members(tp)) is not None:
        if NoneType in members and is_none_word(text):
            return None
        return _first_fit(text, members, _from_text)
    if (item := list_item_type(tp)) is not None:
        return [_from_text(part, item) for part in split_list_text(text)]
    raise ConfigError(f"field type {tp!r} is not supported by the config parser")


def _from_native(value: Any, tp: Any) -> Any:
    if tp is bool:
        return _require(value, isinstance(value, bool))
    if tp is int:
        return _require(value, isinstance(value, int) and not isinstance(value, bool))
    if tp is float:
        return float(_require(value, isinstance(value, (int, float)) and not isinstance(value, bool)))
    if tp is str:
        return _require(value, isinstance(value, str))
    if (values := literal_values(tp)) is not None:
        return _require(value, any(type(value) is type(v) and value == v for v in values))
    if (members := union_members(tp)) is not None:
        if NoneType in members and (value is None or (isinstance(value, str) and is_none_word(value))):
            return None
        return _first_fit(value, members, _from_native)
    if (item := list_item_type(tp)) is not None:
        return [_from_native(v, item) for v in _require(value, isinstance(value, list))]
    raise ConfigError(f"field type {tp!r} is not supported by the config parser")


def _first_fit(value: Any, members: tuple[Any, ...], convert: Callable[[Any, Any], Any]) -> Any:
    # Most specific first, so "3" becomes an int in an `int | str` field rather than a string.
    for member in sorted((m for m in members if m is not NoneType), key=_specificity):
        try:
            return convert(value, member)
        except _Mismatch:
            continue
    raise _Mismatch


def _specificity(tp: Any) -> int:
    order = [bool, int, float]
    if literal_values(tp) is not None:
        return 0
    if tp in order:
        return 1 + order.index(tp)
    return 5 if tp is str else 4


def _call(parse: Callable[[str], Any], text: str) -> Any:
    try:
        return parse(text)
    except ValueError:
        raise _Mismatch from None


def _require(value: Any, ok: bool) -> Any:
    if not ok:
        raise _Mismatch
    return value


def _literal_hint(text: str, tp: Any) -> str:
    # Also inside `Literal[...] | None`.
    candidates = [tp, *(union_members(tp) or ())]
    values = [str(v) for c in candidates for v in (literal_values(c) or ())]
    return did_you_mean(closest(text, values)) if values else ""
