"""Config trees to dicts and TOML text, and TOML override files back to dicts.

The TOML written here is complete (every field, defaults included), so loading it with
``--config-file`` on top of any config of the same root reproduces the config exactly.
TOML has no null: None is written as a comment, ``# n_layers = None (unset)``, which
``load_toml_overrides`` reads back as None (so the file stays exact on top of a base config that sets
the field); the string ``"none"`` is read as None too, as files of older versions wrote it.
Typed-config list entries are ``[[section.list]]`` tables starting with ``kind = "..."``; an empty
typed list is written ``list = []``.
"""
from __future__ import annotations

import math
import re
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
            text = f.read().decode("utf-8")
        data = tomllib.loads(text)
        _read_unset_comments(text, data)
        return data
    except UnicodeDecodeError as err:
        raise ConfigError(f"config file '{path}' is not UTF-8 text: {err}") from None
    except FileNotFoundError:
        raise ConfigError(f"config file '{path}' not found") from None
    except tomllib.TOMLDecodeError as err:
        raise ConfigError(f"config file '{path}' is not valid TOML: {err}") from None
    except OSError as err:
        raise ConfigError(f"cannot read config file '{path}': {err}") from None


_UNSET_COMMENT = re.compile(r"^#\s*([A-Za-z_][A-Za-z0-9_]*)\s*=\s*None \(unset\)\s*$")


def _read_unset_comments(text: str, data: dict[str, Any]) -> None:
    """Put ``"none"`` (read as None) into ``data`` for each ``# key = None (unset)`` line, in the table
    (or array-of-tables entry) it stands in; keys the file also sets are left alone."""
    table: dict[str, Any] = data
    for raw in text.splitlines():
        line = raw.strip()
        if line.startswith("[["):
            entries = _lookup(data, line[2:-2])
            table = entries[-1] if isinstance(entries, list) and entries else {}
        elif line.startswith("["):
            found = _lookup(data, line[1:-1])
            table = found if isinstance(found, dict) else {}
        elif (match := _UNSET_COMMENT.match(line)) is not None:
            table.setdefault(match.group(1), "none")


def _lookup(data: dict[str, Any], dotted: str) -> Any:
    node: Any = data
    for name in dotted.strip().split("."):
        if isinstance(node, list):  # a table under an array of tables belongs to its last entry
            node = node[-1] if node else None
        node = node.get(name) if isinstance(node, dict) else None
    return node


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
        elif value is None:
            lines.append(f"# {f.name} = None (unset)")
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
