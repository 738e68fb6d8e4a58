"""Apply dotted-key overrides (``training.steps = 20``) to a tree of config dataclasses.

Keys walk sections (``section.field``, ``a.b.c``) and typed-config lists by index
(``model_converters.converters.0.recipe_name``). A typed-config list itself is set from kind names
(``float8,other`` on the command line; ``["float8"]`` or ``[[...]]`` tables with ``kind = ...`` in
TOML). After all overrides are applied, every config's ``__post_init__`` runs again so value
checks see the final values; its ValueError becomes a ConfigError naming the keys that were set.

A config class may declare fields that belong to another one (``belongs_to = {"dataset_config":
"dataset"}``): such a field describes the value of its owner, so an override that replaces the owner
without also setting the field (in the same file or command line, or later) returns it to its
default rather than carrying the base config's value over to something it does not describe.
"""
from __future__ import annotations

import copy
import dataclasses
from collections.abc import Iterable, Iterator, Mapping
from typing import Any, TypeVar

from torchtitan_lite.config.errors import ConfigError, closest, did_you_mean
from torchtitan_lite.config.field_types import (
    accepts_bool,
    config_fields,
    field_type,
    is_section,
    kinds,
    type_name,
    typed_list_base,
)
from torchtitan_lite.config.values import from_cli_text, from_toml_value, split_list_text

CLI = "cli"
T = TypeVar("T")
# id(config object) -> (the object, labels of the overrides that changed it or something below it).
# The object is kept so its id cannot be reused by a new object while overrides are applied.
_Touched = dict[int, tuple[Any, list[str]]]
# (config object, field name, origin, whether the value changed) of every field an override wrote, in order.
_Writes = list[tuple[Any, str, str, bool]]


@dataclasses.dataclass(frozen=True)
class Override:
    """One requested change: a dotted key, its value, and where it came from."""

    key: str
    """Dotted key, e.g. ``training.steps`` or ``model_converters.converters.0.recipe_name``."""
    value: Any
    """Command line: the text after the flag, None when the flag had none. File: the TOML value."""
    origin: str = CLI
    """``"cli"`` or the path of the config file."""

    @property
    def from_cli(self) -> bool:
        return self.origin == CLI

    @property
    def label(self) -> str:
        """How the key is shown in errors: ``--training.steps`` or ``training.steps (in f.toml)``."""
        return f"--{self.key}" if self.from_cli else f"{self.key} (in {self.origin})"


def overrides_from_dict(data: Mapping[str, Any], origin: str) -> list[Override]:
    """Flatten nested TOML tables into dotted-key overrides, in document order."""
    result = []
    for name, value in data.items():
        if isinstance(value, Mapping):
            result += [Override(f"{name}.{o.key}", o.value, origin) for o in overrides_from_dict(value, origin)]
        else:
            result.append(Override(name, value, origin))
    return result


def apply_overrides(config: T, overrides: Iterable[Override], *, base_label: str = "the base config") -> T:
    """Return a copy of ``config`` with ``overrides`` applied in order, then validated.

    ``config`` itself is never modified. ``base_label`` names the starting config in errors raised
    by values no override touched (e.g. ``"config 'llama3_debug'"``).
    """
    result = copy.deepcopy(config)
    touched: _Touched = {}
    writes: _Writes = []
    for override in overrides:
        _apply(result, override, touched, writes)
    _reset_orphaned_fields(writes)
    _validate(result, touched, base_label)
    return result


def _apply(root: Any, override: Override, touched: _Touched, writes: _Writes) -> None:
    owner, name, chain = _resolve(root, override)
    tp = field_type(type(owner), name)
    base = typed_list_base(tp)
    entry_fields: list[tuple[int, dict]] = []
    if base is None:
        value = _leaf_value(tp, override)
    else:
        value, entry_fields = _typed_entries(base, override)
    changed = getattr(owner, name) != value
    setattr(owner, name, value)
    writes.append((owner, name, override.origin, changed))
    for obj in chain:
        touched.setdefault(id(obj), (obj, []))[1].append(override.label)
    # Fields written in [[list]] tables go through the same path as any key: same checks, same messages.
    for index, fields in entry_fields:
        for sub in overrides_from_dict(fields, override.origin):
            _apply(root, Override(f"{override.key}.{index}.{sub.key}", sub.value, override.origin), touched, writes)


def _reset_orphaned_fields(writes: _Writes) -> None:
    """A field that belongs to another (``belongs_to``) goes back to its default when its owner was changed
    and the field was not set along with it: by the same origin, or by a later override."""
    for i, (obj, name, origin, changed) in enumerate(writes):
        for dependent, owner in getattr(type(obj), "belongs_to", {}).items():
            set_along = any(o is obj and n == dependent and (org == origin or j > i)
                            for j, (o, n, org, _) in enumerate(writes))
            if owner == name and changed and not set_along:
                setattr(obj, dependent, _default(type(obj), dependent))


def _default(cls: type, name: str) -> Any:
    f = next(f for f in dataclasses.fields(cls) if f.name == name)
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default


def _resolve(root: Any, override: Override) -> tuple[Any, str, list[Any]]:
    """Walk to the object owning the key's last field: (owner, field name, [root, ..., owner])."""
    parts = override.key.split(".")
    chain, obj, i = [root], root, 0
    while i < len(parts) - 1:
        tp = _field_type_or_error(root, obj, parts, i, override)
        if typed_list_base(tp) is not None:
            obj = _entry_at(getattr(obj, parts[i]), parts, i + 1, override)
            i += 2
        elif is_section(tp):
            obj = getattr(obj, parts[i])
            i += 1
        else:
            where = ".".join(parts[: i + 1])
            raise ConfigError(f"{override.label}: '{where}' is a {type_name(tp)} value, not a section")
        chain.append(obj)
    if i == len(parts):
        list_key = ".".join(parts[:-1])
        raise ConfigError(f"{override.label} names a whole entry of {list_key}; set one of its fields "
                          f"(--{override.key}.FIELD)")
    _field_type_or_error(root, obj, parts, i, override)
    return obj, parts[i], chain


def _field_type_or_error(root: Any, obj: Any, parts: list[str], i: int, override: Override) -> Any:
    tp = field_type(type(obj), parts[i])
    if tp is not None:
        return tp
    names = [f.name for f, _ in config_fields(type(obj))]
    prefix = ".".join(parts[:i])
    suggestions = [_join(prefix, m) for m in closest(parts[i], names)] or _same_name_elsewhere(type(root), parts[i])
    bad = ".".join(parts[: i + 1])
    if i == len(parts) - 1:
        message = f"unknown key '{bad}'" + ("" if override.from_cli else f" (in {override.origin})")
    else:
        message = f"unknown section '{bad}' in {override.label}"
    if suggestions:
        raise ConfigError(message + did_you_mean(suggestions))
    scope = f" of '{prefix}'" if prefix else ""
    raise ConfigError(f"{message}; valid keys{scope}: {', '.join(names)}")


def _same_name_elsewhere(root_cls: type, name: str) -> list[str]:
    """Keys in other sections whose last part looks like ``name`` (``training.lr`` -> ``optimizer.lr``)."""
    keys = list(_all_keys(root_cls, ""))
    wanted = set(closest(name, {k.rsplit(".", 1)[-1] for k in keys}, n=1))
    return [k for k in keys if k.rsplit(".", 1)[-1] in wanted][:3]


def _all_keys(cls: type, prefix: str) -> Iterator[str]:
    for f, tp in config_fields(cls):
        key = _join(prefix, f.name)
        if is_section(tp):
            yield from _all_keys(tp, key)
        else:
            yield key


def _entry_at(entries: list[Any], parts: list[str], j: int, override: Override) -> Any:
    list_key = ".".join(parts[:j])
    if j == len(parts) or not parts[j].isdigit():
        field = parts[j] if j < len(parts) else "FIELD"
        raise ConfigError(f"{override.label}: {list_key} is a list of typed configs; address an entry by "
                          f"index, e.g. --{list_key}.0.{field}")
    index = int(parts[j])
    if index >= len(entries):
        raise ConfigError(f"{override.label}: {list_key} has {len(entries)} entries, so there is no entry "
                          f"{index}; set the list first (--{list_key} KIND,... or [[{list_key}]] tables)")
    return entries[index]


def _leaf_value(tp: Any, override: Override) -> Any:
    if is_section(tp):
        example = config_fields(tp)[0][0].name if config_fields(tp) else "FIELD"
        how = f"e.g. --{override.key}.{example} VALUE" if override.from_cli else f"in a [{override.key}] table"
        raise ConfigError(f"{override.label} is a section, not a value; set its fields, {how}")
    if override.from_cli and override.value is None:
        if accepts_bool(tp):
            return True  # a bare bool flag switches it on
        raise ConfigError(f"{override.label} needs a value: {override.label} VALUE or {override.label}=VALUE")
    if override.from_cli:
        return from_cli_text(override.value, tp, override.label)
    return from_toml_value(override.value, tp, override.label)


def _typed_entries(base: type, override: Override) -> tuple[list[Any], list[tuple[int, dict]]]:
    """Default entries for the requested kinds, and (index, field table) pairs still to apply."""
    value = override.value
    if override.from_cli:
        if value is None:
            raise ConfigError(f"{override.label} needs a comma-separated list of kinds "
                              f"(one of {', '.join(kinds(base))}), or '' for none")
        value = split_list_text(value)
    if not isinstance(value, list):
        raise ConfigError(f"{override.label} expects a list of kinds or [[{override.key}]] tables, got {value!r}")
    entries, entry_fields = [], []
    for index, item in enumerate(value):
        if isinstance(item, Mapping):
            fields = dict(item)
            kind = fields.pop("kind", None)
            if kind is None and len(kinds(base)) == 1:  # a list of one kind of entry needs no kind = ...
                (kind,) = kinds(base)
            if kind is None:
                raise ConfigError(f"{override.label}: entry {index} needs a kind = ... key "
                                  f"(one of {', '.join(kinds(base))})")
            entry_fields.append((index, fields))
        else:
            kind = item
        entries.append(_new_entry(base, kind, override))
    return entries, entry_fields


def _new_entry(base: type, kind: Any, override: Override) -> Any:
    registry = kinds(base)
    if kind not in registry:
        hint = did_you_mean(closest(kind, registry)) if isinstance(kind, str) else ""
        raise ConfigError(f"{override.label}: unknown kind {kind!r}{hint}; kinds: {', '.join(registry)}")
    try:
        return registry[kind]()
    except ValueError as err:
        raise ConfigError(f"{override.label}: the default {kind} config is invalid: {err}") from err


def _validate(root: Any, touched: _Touched, base_label: str) -> None:
    # Innermost first, so a bad field is reported by its own section rather than by a parent.
    for obj in reversed(list(_iter_configs(root))):
        post_init = getattr(obj, "__post_init__", None)
        if post_init is None:
            continue
        try:
            post_init()
        except ValueError as err:
            labels = list(dict.fromkeys(touched.get(id(obj), (None, []))[1]))
            if labels:
                raise ConfigError(f"invalid value for {', '.join(labels)}: {err}") from err
            raise ConfigError(f"{base_label} is invalid: {err}") from err


def _iter_configs(obj: Any) -> Iterator[Any]:
    """Every config dataclass in the tree, parents before children."""
    yield obj
    for f, tp in config_fields(type(obj)):
        value = getattr(obj, f.name)
        if is_section(tp) and dataclasses.is_dataclass(value):
            yield from _iter_configs(value)
        elif typed_list_base(tp) is not None:
            for entry in value:
                yield from _iter_configs(entry)


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name
