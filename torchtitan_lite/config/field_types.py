"""What the config parser knows about field types.

Supported field types: bool, int, float, str, ``X | None``, ``Literal[...]``, ``list[X]`` of those
scalars, nested config dataclasses ("sections"), and typed-config lists: ``list[Base]`` where
``Base`` is a dataclass with a classmethod ``registry() -> dict[str, type]`` mapping a kind name to
a Config subclass that carries ``kind: ClassVar[str]``.
"""
from __future__ import annotations

import dataclasses
import functools
import types
import typing
from typing import Any, Literal, Union

from torchtitan_lite.config.errors import ConfigError

NoneType = type(None)
SCALARS = (bool, int, float, str)


def config_fields(cls: type) -> tuple[tuple[dataclasses.Field, Any], ...]:
    """The settable fields of a config dataclass with their resolved types, in declaration order (cached).

    Fields with ``init=False`` or a leading underscore are internal and not part of the config.
    """
    return _config_fields(cls)


@functools.cache
def _config_fields(cls: type) -> tuple[tuple[dataclasses.Field, Any], ...]:
    """The settable fields of a config dataclass with their resolved types, in declaration order.

    Fields with ``init=False`` or a leading underscore are internal and not part of the config.
    """
    try:
        hints = typing.get_type_hints(cls)
    except Exception as err:  # any unresolvable annotation makes the class unusable as a config
        raise ConfigError(f"cannot resolve the field types of {cls.__qualname__}: {err}") from err
    return tuple(
        (f, hints[f.name]) for f in dataclasses.fields(cls) if f.init and not f.name.startswith("_")
    )


def field_type(cls: type, name: str) -> Any | None:
    """The resolved type of field ``name`` of ``cls``, or None when there is no such config field."""
    for f, tp in config_fields(cls):
        if f.name == name:
            return tp
    return None


def is_section(tp: Any) -> bool:
    """A nested config dataclass (its fields are set as ``section.field``)."""
    return isinstance(tp, type) and dataclasses.is_dataclass(tp)


def typed_list_base(tp: Any) -> type | None:
    """For ``list[Base]`` where Base has ``registry()``, return Base; otherwise None."""
    if typing.get_origin(tp) is not list:
        return None
    (arg,) = typing.get_args(tp)
    if is_section(arg) and callable(getattr(arg, "registry", None)):
        return arg
    return None


def kinds(base: type) -> dict[str, type]:
    """Kind name -> Config class of a typed-config list."""
    return dict(base.registry())  # type: ignore[attr-defined]  # typed-list bases define registry()


def kind_of(entry: Any) -> str:
    """The kind name a typed-config list entry is written with."""
    kind = getattr(type(entry), "kind", None)
    if not isinstance(kind, str) or not kind:
        raise ConfigError(f"{type(entry).__qualname__} has no 'kind' class attribute naming it in its registry")
    return kind


def union_members(tp: Any) -> tuple[Any, ...] | None:
    """The members of ``A | B`` / ``Optional[A]``, or None when ``tp`` is not a union."""
    if typing.get_origin(tp) in (Union, types.UnionType):
        return typing.get_args(tp)
    return None


def accepts_none(tp: Any) -> bool:
    """Whether None is a valid value (``X | None``)."""
    members = union_members(tp)
    return members is not None and NoneType in members


def accepts_bool(tp: Any) -> bool:
    """Whether a bare command-line flag (no value) can mean true for this type."""
    return tp is bool or bool in (union_members(tp) or ())


def literal_values(tp: Any) -> tuple[Any, ...] | None:
    """The allowed values of ``Literal[...]``, or None for other types."""
    if typing.get_origin(tp) is Literal:
        return typing.get_args(tp)
    return None


def list_item_type(tp: Any) -> Any | None:
    """X for ``list[X]`` (a list of scalars), None for other types."""
    if typing.get_origin(tp) is list and typed_list_base(tp) is None:
        return typing.get_args(tp)[0]
    return None


def type_name(tp: Any) -> str:
    """Short type name for ``--help``: ``int``, ``int | None``, ``{none,full}``, ``list[str]``."""
    if tp in SCALARS:
        return tp.__name__
    if (values := literal_values(tp)) is not None:
        return "{" + ",".join(str(v) for v in values) + "}"
    if (members := union_members(tp)) is not None:
        return " | ".join("None" if m is NoneType else type_name(m) for m in members)
    if (base := typed_list_base(tp)) is not None:
        return "list[{" + ",".join(kinds(base)) + "}]"
    if (item := list_item_type(tp)) is not None:
        return f"list[{type_name(item)}]"
    if is_section(tp):
        return tp.__name__
    return repr(tp)


def describe_type(tp: Any) -> str:
    """Type as read in an error: ``an int``, ``one of 'a', 'b'``, ``a list of float``."""
    if tp is bool:
        return "a bool (true/false/yes/no/1/0)"
    if tp is int:
        return "an int"
    if tp is float:
        return "a float"
    if tp is str:
        return "a string"
    if (values := literal_values(tp)) is not None:
        return "one of " + ", ".join(repr(v) for v in values)
    if (members := union_members(tp)) is not None:
        described = [describe_type(m) for m in members if m is not NoneType]
        return " or ".join(described + (["none"] if NoneType in members else []))
    if (base := typed_list_base(tp)) is not None:
        return "a list of kinds among " + ", ".join(repr(k) for k in kinds(base))
    if (item := list_item_type(tp)) is not None:
        return f"a list of {type_name(item)}"
    if is_section(tp):
        return f"a table of {tp.__name__} fields"
    return repr(tp)
