"""The config contract: every component owns a nested keyword-only ``Config`` dataclass.

Static settings live in the config; runtime objects (meshes, model, tokenizer) are arguments of
``build``. ``SomeComponent.Config(...).build(**runtime)`` calls ``SomeComponent(config, **runtime)``.

Field documentation is written as a string literal right under each field; ``--help`` reads it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar


class Configurable:
    """Base for components built from a nested ``Config``."""

    @dataclass(kw_only=True)
    class Config:
        _owner: ClassVar[type | None] = None

        def build(self, **runtime: Any) -> Any:
            owner = type(self)._owner
            if owner is None:
                raise TypeError(f"{type(self).__qualname__} has no component to build")
            return owner(self, **runtime)

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        # Bind only a Config defined in this very class, so subclasses without their own Config
        # do not steal their parent's.
        config_cls = cls.__dict__.get("Config")
        if config_cls is not None:
            config_cls._owner = cls

    def __init__(self, config: Configurable.Config, **runtime: Any) -> None:
        self.config = config
