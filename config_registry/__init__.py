"""Named configs: each public function of a module in this package returns a complete root config.

    from config_registry import register

    @register
    def llama3_debug() -> Trainer.Config:
        \"\"\"First docstring line is what --list-configs shows.\"\"\"
        return Trainer.Config(...)

Every module of the package is imported on first use, so adding a module adds its configs.
``get(name)`` calls the function each time: callers always receive a fresh object.
"""
from __future__ import annotations

import contextlib
from typing import Any

from torchtitan_lite.config.registry import ConfigFn, ConfigRegistry

__all__ = ["DEFAULT_REGISTRY", "ConfigFn", "ConfigRegistry", "describe", "get", "names", "register", "registered",
           "unregister"]

DEFAULT_REGISTRY = ConfigRegistry(__name__)
"""The registry of this package; the module-level functions below act on it."""


def register(fn: ConfigFn) -> ConfigFn:
    """Decorator: make ``fn`` selectable as ``--config <fn.__name__>``."""
    return DEFAULT_REGISTRY.register(fn)


def get(name: str) -> Any:
    """A fresh config built by the function registered as ``name``."""
    return DEFAULT_REGISTRY.get(name)


def names() -> list[str]:
    """Registered config names, sorted."""
    return DEFAULT_REGISTRY.names()


def describe() -> list[tuple[str, str]]:
    """(name, first docstring sentence) of every registered config, sorted by name."""
    return DEFAULT_REGISTRY.describe()


def unregister(name: str) -> None:
    """Remove a registered config (for tests)."""
    DEFAULT_REGISTRY.unregister(name)


def registered(*fns: ConfigFn) -> contextlib.AbstractContextManager[None]:
    """Register ``fns`` for the duration of a ``with`` block (for tests)."""
    return DEFAULT_REGISTRY.registered(*fns)
