"""Config trees to dicts and TOML text, and TOML override files back to dicts.

The TOML written here is complete (every field, defaults included), so loading it with
``--config-file`` on top of any config of the same root reproduces the config exactly.
TOML has no null: None is written as the string ``"none"``, which ``X | None`` fields read back as
None. Typed-config list entries are ``[[section.list]]`` tables starting with ``kind = "..."``; an
empty typed list is written ``list = []``.
"""
from __future__ import annotations

import math
import sys
from typing import Any

from torchtitan_lite.config.errors import ConfigError
from torchtitan_lite.config.field_types import accepts_none, config_fields, is_section, kind_of, typed_list_base
from torchtitan_lite.config.values import is_none_word

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - the package depends on tomli there
    import tomli as tomllib


def config_to_dict(config: Any) -> dict[str, Any]:
    """Nested plain dict of a config tree; typed-config list entries get a leading ``kind`` key."""
    result: dict[str, Any] = {}
    for f, tp in config_fields(type(config)):
        value = getattr(config, f.name)
        if is_section(tp):
            result[f.name] = config_to_dict(value)
        elif typed_list_base(tp) is not None:
            result[f.name] = [{"kind": kind_of(entry), **config_to_dict(entry)} for entry in value]
        elif isinstance(value, list):
            result[f.name] = list(value)
        else:
            result[f.name] = value
    return result


def config_to_toml(config: Any) -> str:
    """The whole config as TOML text that round-trips exactly through ``--config-file``."""
    lines: list[str] = []
    _write_table(config, [], lines, header=None)
    return "\n".join(lines).lstrip("\n") + "\n"


def load_toml_overrides(path: str) -> dict[str, Any]:
    """Read a TOML override file into a nested dict; a missing file or bad TOML is a ConfigError."""
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except FileNotFoundError:
        raise ConfigError(f"config file '{path}' not found") from None
    except tomllib.TOMLDecodeError as err:
        raise ConfigError(f"config file '{path}' is not valid TOML: {err}") from None
    except OSError as err:
        raise ConfigError(f"cannot read config file '{path}': {err}") from None


def _write_table(config: Any, path: list[str], lines: list[str], header: str | None, kind: str | None = None) -> None:
    # TOML needs all plain keys of a table before its sub-tables.
    if header is not None:
        lines += ["", header]
    if kind is not None:
        lines.append(f"kind = {_toml_string(kind)}")
    subtables = []
    for f, tp in config_fields(type(config)):
        value = getattr(config, f.name)
        key = ".".join(path + [f.name])
        if is_section(tp) or (typed_list_base(tp) is not None and value):
            subtables.append((f.name, tp, value))
        else:
            lines.append(f"{f.name} = {_toml_value(value, tp, key)}")
    for name, tp, value in subtables:
        dotted = ".".join(path + [name])
        if is_section(tp):
            _write_table(value, path + [name], lines, f"[{dotted}]")
        else:
            for entry in value:
                _write_table(entry, path + [name], lines, f"[[{dotted}]]", kind=kind_of(entry))


def _toml_value(value: Any, tp: Any, key: str) -> str:
    if value is None:
        return '"none"'
    if isinstance(value, str) and accepts_none(tp) and is_none_word(value):
        raise ConfigError(f"{key}={value!r} cannot be written as TOML: in an optional field that text "
                          f"reads back as None; use None or another string")
    return _toml_scalar(value, key)


def _toml_scalar(value: Any, key: str) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        return repr(value)
    if isinstance(value, str):
        return _toml_string(value)
    if isinstance(value, list):
        return "[" + ", ".join(_toml_scalar(v, key) for v in value) + "]"
    raise ConfigError(f"{key} holds a {type(value).__name__}, which cannot be written as TOML")


def _toml_string(text: str) -> str:
    escaped = []
    for ch in text:
        if ch in '"\\':
            escaped.append("\\" + ch)
        elif ch == "\n":
            escaped.append("\\n")
        elif ch == "\t":
            escaped.append("\\t")
        elif ord(ch) < 0x20 or ord(ch) == 0x7F:
            escaped.append(f"\\u{ord(ch):04x}")
        else:
            escaped.append(ch)
    return '"' + "".join(escaped) + '"'
