"""A registry of named config functions, filled by importing every module of a package on first use.

The ``config_registry`` package holds the project's configs in one such registry; the entry points pass
it to ``parse_cli`` and the actions (the core never imports that package).
"""
from __future__ import annotations

import contextlib
import dataclasses
import importlib
import inspect
import pkgutil
from collections.abc import Callable, Iterator
from typing import Any

from torchtitan_lite.config.errors import ConfigError, closest, did_you_mean

ConfigFn = Callable[[], Any]


class ConfigRegistry:
    """Name -> config function, filled by importing every module of ``package`` on first use."""

    def __init__(self, package: str | None) -> None:
        self.package = package
        self._functions: dict[str, ConfigFn] = {}
        self._loaded = package is None

    def register(self, fn: ConfigFn) -> ConfigFn:
        """Decorator: register ``fn`` under its ``__name__``; a name may be registered only once."""
        name = fn.__name__
        if name in self._functions:
            raise ConfigError(f"config '{name}' is registered twice ({_where(self._functions[name])} and "
                              f"{_where(fn)}); rename one of them")
        self._functions[name] = fn
        return fn

    def unregister(self, name: str) -> None:
        """Remove a registered config (for tests)."""
        del self._functions[name]

    @contextlib.contextmanager
    def registered(self, *fns: ConfigFn) -> Iterator[None]:
        """Register ``fns`` for the duration of a ``with`` block (for tests)."""
        added = []
        try:
            for fn in fns:
                self.register(fn)
                added.append(fn.__name__)
            yield
        finally:
            for name in added:
                del self._functions[name]

    def get(self, name: str) -> Any:
        """A fresh config built by the function registered as ``name``."""
        self._load()
        fn = self._functions.get(name)
        if fn is None:
            hint = did_you_mean(closest(name, self._functions)) or f" (known: {', '.join(self.names())})"
            raise ConfigError(f"unknown config '{name}'{hint}; run with --list-configs to see them all")
        config = fn()
        if not dataclasses.is_dataclass(config) or isinstance(config, type):
            raise ConfigError(f"config function {_where(fn)} returned {type(config).__name__}, not a config dataclass")
        return config

    def names(self) -> list[str]:
        """Registered config names, sorted."""
        self._load()
        return sorted(self._functions)

    def describe(self) -> list[tuple[str, str]]:
        """(name, first docstring line) of every registered config, sorted by name."""
        self._load()
        return [(name, _first_line(self._functions[name])) for name in sorted(self._functions)]

    def _load(self) -> None:
        if self._loaded or self.package is None:
            return
        package = importlib.import_module(self.package)
        for module in pkgutil.iter_modules(package.__path__):
            if not module.name.startswith("_"):
                importlib.import_module(f"{self.package}.{module.name}")
        self._loaded = True


def _where(fn: ConfigFn) -> str:
    return f"{fn.__module__}.{fn.__qualname__}"


def _first_line(fn: ConfigFn) -> str:
    doc = inspect.getdoc(fn) or ""
    return doc.splitlines()[0] if doc else ""
