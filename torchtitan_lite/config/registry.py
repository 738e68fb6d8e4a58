"""A registry of named config functions, filled by importing every module of a package on first use.

The ``config_registry`` package holds the project's configs in one such registry; the entry points pass
it to ``parse_cli`` and the actions (the core never imports that package). A module that fails to import
(a syntax error, a missing import, an exception) is set aside with its path and error: the other modules'
configs still work, --list-configs warns, and asking for a config that file defines is an error naming it.
"""
from __future__ import annotations

import contextlib
import dataclasses
import importlib
import inspect
import logging
import pkgutil
import re
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from torchtitan_lite.config.dump_folder import with_default_dump_folder
from torchtitan_lite.config.errors import ConfigError, closest, did_you_mean

ConfigFn = Callable[[], Any]
logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class BrokenModule:
    """A module of the registry's package that raised while being imported; none of its configs is used."""

    path: str
    error: str
    defines: frozenset[str]
    """Names the file defines with ``def`` (read from its text, as it may not even parse): configs that may live there."""

    def summary(self) -> str:
        return f"{self.path} fails to import, its configs are not available: {self.error}"


class ConfigRegistry:
    """Name -> config function, filled by importing every module of ``package`` on first use."""

    def __init__(self, package: str | None) -> None:
        self.package = package
        self._functions: dict[str, ConfigFn] = {}
        self._broken: list[BrokenModule] = []
        self._loaded = package is None
        self._warned = False

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
        """A fresh config built by the function registered as ``name``, writing to its own dump folder
        (``./outputs/<name>``) unless it names one (config/dump_folder.py)."""
        self._load()
        home = next((broken for broken in self._broken if name in broken.defines), None)
        if home is not None:
            raise ConfigError(f"config '{name}' is defined in {home.path}, which fails to import: {home.error}; "
                              "fix that file (the configs of the other files still work)")
        fn = self._functions.get(name)
        if fn is None:
            hint = did_you_mean(closest(name, self._functions)) or f" (known: {', '.join(self.names())})"
            raise ConfigError(f"unknown config '{name}'{hint}; run with --list-configs to see them all"
                              + "".join(f"; {broken.path} fails to import ({broken.error}): a config there "
                                        "is not available until it is fixed" for broken in self._broken))
        if self._broken and not self._warned:
            self._warned = True
            for broken in self._broken:
                logger.warning("%s", broken.summary())
        config = fn()
        if not dataclasses.is_dataclass(config) or isinstance(config, type):
            raise ConfigError(f"config function {_where(fn)} returned {type(config).__name__}, not a config dataclass")
        return with_default_dump_folder(config, name)

    def names(self) -> list[str]:
        """Registered config names, sorted."""
        self._load()
        return sorted(self._functions)

    def describe(self) -> list[tuple[str, str]]:
        """(name, first docstring sentence) of every registered config, sorted by name."""
        self._load()
        return [(name, _first_sentence(self._functions[name])) for name in sorted(self._functions)]

    def broken_modules(self) -> list[BrokenModule]:
        """The package's modules that failed to import, in import order."""
        self._load()
        return list(self._broken)

    def _load(self) -> None:
        if self._loaded or self.package is None:
            return
        package = importlib.import_module(self.package)
        for module in pkgutil.iter_modules(package.__path__):
            if module.name.startswith("_"):
                continue
            before = set(self._functions)
            try:
                importlib.import_module(f"{self.package}.{module.name}")
            except Exception as err:  # a user's file may fail in any way; it must not take the other configs down
                for name in set(self._functions) - before:  # registered before the failure: the file is not used
                    del self._functions[name]
                self._broken.append(_broken_module(module, err))
        self._loaded = True


def _broken_module(module: pkgutil.ModuleInfo, err: Exception) -> BrokenModule:
    folder = Path(getattr(module.module_finder, "path", "."))
    path = folder / module.name / "__init__.py" if module.ispkg else folder / f"{module.name}.py"
    try:
        source = path.read_text(errors="replace")
    except OSError:
        source = ""
    return BrokenModule(path=_shown(path), error=_error_text(err, path),
                        defines=frozenset(re.findall(r"^\s*def\s+(\w+)\s*\(", source, flags=re.M)))


def _error_text(err: Exception, path: Path) -> str:
    """``Type: message`` with the failing line of the file itself (not of what it imported)."""
    if isinstance(err, SyntaxError) and err.filename and Path(err.filename).resolve() == path.resolve():
        return f"{type(err).__name__} at line {err.lineno}: {err.msg}"
    lines = [frame.lineno for frame in traceback.extract_tb(err.__traceback__)
             if Path(frame.filename).resolve() == path.resolve()]
    where = f" at line {lines[-1]}" if lines else ""
    return f"{type(err).__name__}{where}: {err}"


def _shown(path: Path) -> str:
    """Relative to the working folder when it is below it (as a user would type it), else absolute."""
    try:
        return str(path.resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(path)


def _where(fn: ConfigFn) -> str:
    return f"{fn.__module__}.{fn.__qualname__}"


_SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[A-Z])")
"""A full stop (or ! ?) followed by a capital: where the first sentence ends ('e.g. wq' and '4.8M' do not)."""


def _first_sentence(fn: ConfigFn) -> str:
    """The first sentence of the docstring's first paragraph, its lines joined: a docstring's first line often
    stops mid-sentence where the source wraps it."""
    doc = inspect.getdoc(fn) or ""
    paragraph = " ".join(doc.split("\n\n")[0].split())
    return _SENTENCE_END.split(paragraph, maxsplit=1)[0]
