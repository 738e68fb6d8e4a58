"""The package's modules form layers: no module imports, directly or through others, one that imports it.

Every import counts, read from the source with ``ast``: module level, inside functions (a lazy import that
dodges a cycle at runtime is still one) and under ``TYPE_CHECKING`` (a low layer typed with a high one is
tied to it all the same).
"""
from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "torchtitan_lite"


def _modules() -> dict[str, Path]:
    modules = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


MODULES = _modules()


def _owner(name: str) -> str | None:
    """The package module that ``name`` (a module, or a name inside one) belongs to; None outside the package."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def _imports(module: str) -> set[str]:
    path = MODULES[module]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, *([node.module] if node.module else [])])
            # ``from pkg import sub`` imports the submodule; ``from mod import name`` the module.
            names = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in MODULES else base for alias in node.names]
        else:
            continue
        found |= {owner for name in names if (owner := _owner(name)) is not None and owner != module}
    return found


GRAPH = {module: _imports(module) for module in MODULES}


def _cycles() -> list[list[str]]:
    """One cycle (as a path that returns to its start) per strongly connected group of modules."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    groups: list[set[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(GRAPH[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = set()
            while True:
                w = stack.pop()
                group.add(w)
                if w == v:
                    break
            if len(group) > 1:
                groups.append(group)

    for module in sorted(GRAPH):
        if module not in index:
            visit(module)
    return [_path_within(group) for group in groups]


def _path_within(group: set[str]) -> list[str]:
    start = min(group)
    path, seen = [start], {start}
    while True:
        step = min(w for w in GRAPH[path[-1]] if w in group)
        path.append(step)
        if step in seen:
            return path[path.index(step):]
        seen.add(step)


def test_the_graph_is_read_from_the_source():
    # The walk finds the imports it must (a regression in the reader would make the cycle test vacuous).
    assert "torchtitan_lite.resolved_run" in GRAPH["torchtitan_lite.trainer"]
    assert "torchtitan_lite.components.data.sources" in GRAPH["torchtitan_lite.components.data.dataloader"]
    assert "torchtitan_lite.protocols.model" in GRAPH["torchtitan_lite.protocols.model_spec"]
    assert len(GRAPH) > 100


def test_no_import_cycles():
    assert _cycles() == []


PROTOCOL_DEPENDENCIES = ("torchtitan_lite.protocols", "torchtitan_lite.config",
                         "torchtitan_lite.mesh.parallel_dims", "torchtitan_lite.mesh.process_groups")
"""What the model protocols may import: themselves, the config, the parallel degrees and the process-group
helpers. Never the resolved run, the trainer or the components."""


@pytest.mark.parametrize("module", sorted(m for m in MODULES if m.startswith("torchtitan_lite.protocols")))
def test_the_protocols_import_only_the_layers_below_them(module):
    above = {m for m in GRAPH[module] if not m.startswith(PROTOCOL_DEPENDENCIES)}
    assert above == set(), f"{module} imports {sorted(above)}"


@pytest.mark.parametrize("module", ["torchtitan_lite.components.data.records",
                                    "torchtitan_lite.components.data.sources",
                                    "torchtitan_lite.protocols.model_spec"])
def test_formerly_cyclic_modules_import_first_in_a_fresh_interpreter(module):
    result = subprocess.run([sys.executable, "-c", f"import {module}"], cwd=PACKAGE.parent, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
