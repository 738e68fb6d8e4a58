"""Field documentation: the string literal written right under each dataclass field.

    @dataclass(kw_only=True)
    class TrainingConfig:
        steps: int = 300
        \"\"\"Number of optimizer steps to train.\"\"\"

The docs are read from the class source with ``ast``; base classes are searched too, so
inherited fields keep their docs.
"""
from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import textwrap
from collections.abc import Iterator
from typing import Any, NamedTuple

from torchtitan_lite.config.field_types import config_fields, is_section, kind_of, kinds, type_name, typed_list_base


def field_docs(cls: type) -> dict[str, str]:
    """Field name -> doc of a class, including docs of fields declared in its bases."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        docs.update(_own_field_docs(klass))
    return docs


class FieldDoc(NamedTuple):
    """One line of the field listing."""

    key: str
    """``training.steps``; fields of a typed-config list kind: ``model_converters.converters[float8].recipe_name``."""
    flag: str
    """``--training.steps``; fields of a typed-config list kind: ``--model_converters.converters.N.recipe_name``;
    for a kind line, the flag selecting it: ``--model_converters.converters float8``."""
    tp: Any
    """Field type; for a kind line, the kind's Config class."""
    default: str
    """Default as typed on the command line; empty for sections and kinds."""
    doc: str
    """Field doc as one paragraph; for a kind line, the first line of the class docstring."""
    role: str
    """``field``, ``section`` or ``kind``."""


def undocumented_fields(root_cls: type) -> list[str]:
    """Dotted keys of every field under ``root_cls`` (sections and typed-list kinds included) without a doc."""
    return [d.key for d in walk_fields(root_cls) if d.role != "kind" and not d.doc]


def fields_help_text(root_cls: type, config: Any = None, config_name: str = "config") -> str:
    """One line per field: ``--section.field  TYPE  (default: X)  doc``, grouped by section. With a
    ``config`` instance, fields whose value there differs from the default show it too:
    ``(default: 300, llama3_debug: 200)``."""
    lines = []
    for d in walk_fields(root_cls):
        if d.role == "section":
            lines += ["", f"[{d.key}]  {d.doc}".rstrip()]
        elif d.role == "kind":
            lines += ["", f"  {d.flag}  {d.doc}".rstrip()]
        else:
            default = f"default: {d.default}"
            value = _value_at(config, d.key)
            if typed_list_base(d.tp) is not None and isinstance(value, list):
                value = [kind_of(entry) for entry in value]  # the entries' fields are their own flags
            if value is not _ABSENT and format_default(value) != d.default:
                default += f", {config_name}: {format_default(value)}"
            lines.append(f"  {d.flag}  {type_name(d.tp)}  ({default})  {d.doc}".rstrip())
    return "\n".join(lines).lstrip("\n")


_ABSENT = object()


def _value_at(config: Any, key: str) -> Any:
    """The value of dotted ``key`` in ``config``; _ABSENT without a config or for typed-list entry fields."""
    if config is None or "[" in key:
        return _ABSENT
    value = config
    for name in key.split("."):
        value = getattr(value, name, _ABSENT)
        if value is _ABSENT:
            return _ABSENT
    return value


def walk_fields(root_cls: type) -> list[FieldDoc]:
    """Every field under ``root_cls``, depth first, with defaults taken from ``root_cls()`` when it
    can be built without arguments (so defaults set by a parent's default_factory show)."""
    return list(_walk(root_cls, _default_instance(root_cls), "", "--"))


def format_default(value: Any) -> str:
    """A default as typed on the command line; strings are quoted so '' and 'none' stay visible."""
    if value is dataclasses.MISSING:
        return "required"
    if value is None:
        return "none"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return repr(value)
    if isinstance(value, list):
        return "[" + ", ".join(format_default(v).strip("'") for v in value) + "]"
    return repr(value)


def _walk(cls: type, instance: Any, key_prefix: str, flag_prefix: str) -> Iterator[FieldDoc]:
    # Plain fields first, then sections and typed-list kinds, so no field lands under a sub-heading.
    docs = field_docs(cls)
    later: list[Iterator[FieldDoc]] = []
    for f, tp in config_fields(cls):
        key, flag = key_prefix + f.name, flag_prefix + f.name
        default = _default(f, instance)
        doc = " ".join(docs.get(f.name, "").split())
        if is_section(tp):
            later.append(_section(tp, default, key, flag, doc))
            continue
        yield FieldDoc(key, flag, tp, format_default(default), doc, "field")
        if (base := typed_list_base(tp)) is not None:
            later.append(_kinds(base, key, flag))
    for block in later:
        yield from block


def _section(tp: type, default: Any, key: str, flag: str, doc: str) -> Iterator[FieldDoc]:
    yield FieldDoc(key, flag, tp, "", doc, "section")
    yield from _walk(tp, default if dataclasses.is_dataclass(default) else None, key + ".", flag + ".")


def _kinds(base: type, key: str, flag: str) -> Iterator[FieldDoc]:
    for kind, kind_cls in kinds(base).items():
        yield FieldDoc(f"{key}[{kind}]", f"{flag} {kind}", kind_cls, "", _class_doc(kind_cls), "kind")
        yield from _walk(kind_cls, _default_instance(kind_cls), f"{key}[{kind}].", f"{flag}.N.")


def _default(f: dataclasses.Field, instance: Any) -> Any:
    if instance is not None:
        return getattr(instance, f.name)
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return dataclasses.MISSING


def _default_instance(cls: type) -> Any:
    """``cls()`` so defaults set by a parent's default_factory show; None when it needs arguments."""
    try:
        return cls()
    except (TypeError, ValueError):
        return None


def _class_doc(cls: type) -> str:
    """First line of the class docstring; dataclass() invents a signature-like one when it is missing."""
    doc = cls.__doc__ or ""
    if doc.startswith(cls.__name__ + "("):
        return ""
    text = inspect.cleandoc(doc)
    return text.splitlines()[0] if text else ""


@functools.cache
def _own_field_docs(cls: type) -> dict[str, str]:
    """Docs of the fields declared in ``cls`` itself (not its bases)."""
    try:
        source = textwrap.dedent(inspect.getsource(cls))
    except (OSError, TypeError):  # builtins and classes made at runtime have no source
        return {}
    class_def = ast.parse(source).body[0]
    assert isinstance(class_def, ast.ClassDef)  # getsource of a class starts with its class statement
    body = class_def.body
    docs = {}
    for stmt, following in zip(body, body[1:]):
        if (
            isinstance(stmt, ast.AnnAssign)
            and isinstance(stmt.target, ast.Name)
            and isinstance(following, ast.Expr)
            and isinstance(following.value, ast.Constant)
            and isinstance(following.value.value, str)
        ):
            docs[stmt.target.id] = inspect.cleandoc(following.value.value)
    return docs
