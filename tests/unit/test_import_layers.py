"""The package's modules form layers: no module imports, directly or through others, one that imports it;
the low layers (protocols/, config/, mesh/) import nothing above them; the core never imports the families
(models/) or the registered configs (config_registry/), and the families import from the core only the
protocols and the parallel layout (each exception named with its reason); no file or function is too long.

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


def _imported_names(path: Path, package: str) -> list[str]:
    """The absolute names a file imports (``from a import b`` gives ``a.b``; relative ones resolved from
    ``package``, the package the file's imports are relative to)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, *([node.module] if node.module else [])])
            found += [f"{base}.{alias.name}" for alias in node.names]
    return found


def _imports(module: str) -> set[str]:
    path = MODULES[module]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    # ``from pkg import sub`` imports the submodule; ``from mod import name`` the module (_owner strips the name).
    return {owner for name in _imported_names(path, package) if (owner := _owner(name)) is not None and owner != module}


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


def _within(module: str, packages: tuple[str, ...]) -> bool:
    return any(module == package or module.startswith(package + ".") for package in packages)


PROTOCOL_DEPENDENCIES = ("torchtitan_lite.protocols", "torchtitan_lite.config", "torchtitan_lite.mesh")
"""The low layers: the model protocols, the config and the parallel layout (degrees, meshes, process groups).
They import only each other, never distributed/, components/, the resolved run, the trainer or the tools, so
every layer above can use them without a cycle."""


@pytest.mark.parametrize("module", sorted(m for m in MODULES if _within(m, PROTOCOL_DEPENDENCIES)))
def test_the_low_layers_import_only_each_other(module):
    above = {m for m in GRAPH[module] if not _within(m, PROTOCOL_DEPENDENCIES)}
    assert above == set(), f"{module} imports {sorted(above)}"


ROOT = PACKAGE.parent
APPLICATION_PACKAGES = ("models", "config_registry")
"""The families and the registered configs: they import the core, which never imports them back (train.py and
scripts/ wire them in)."""

CORE_IMPORTS_OF_APPLICATION = {
    "torchtitan_lite.tools.gpu_check_stages":
        "gpu_check runs as `python -m torchtitan_lite.tools.gpu_check` (scripts/gpu_check.sh), so it is its own "
        "entry point: it registers the families and reads the registry to size its proxy model",
}


def _application_imports(module: str) -> list[str]:
    path = MODULES[module]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    return sorted({name for name in _imported_names(path, package) if name.split(".")[0] in APPLICATION_PACKAGES})


def test_the_core_never_imports_models_or_config_registry():
    found = {module: names for module in sorted(MODULES) if (names := _application_imports(module))}
    unexplained = {m: names for m, names in found.items() if m not in CORE_IMPORTS_OF_APPLICATION}
    assert unexplained == {}, f"torchtitan_lite imports {APPLICATION_PACKAGES}: {unexplained}"
    # A stale exception would let the next such import in unnoticed.
    assert sorted(found) == sorted(CORE_IMPORTS_OF_APPLICATION), "an exception no longer needed: delete it"


MODEL_FILES = sorted((ROOT / "models").rglob("*.py"))
MODELS_IMPORT = ("torchtitan_lite.protocols", "torchtitan_lite.mesh")
"""What the families import from the core: the protocols they implement and the parallel layout."""

MODELS_ALSO_IMPORT = {
    "torchtitan_lite.components.checkpoint.hf_io":
        "the MoE HF adapters rename config.json's alias keys (canonical_names) as the converter's config check "
        "does, so both read transformers 4 and 5 files alike",
    "torchtitan_lite.components.checkpoint.hf_rope":
        "the HF adapters read config.json's RoPE scaling (read_rope, RopeError) with the reader the converter's "
        "config check compares with",
}


def _model_imports(path: Path) -> set[str]:
    module = ".".join(path.relative_to(ROOT).with_suffix("").parts)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    return {owner for name in _imported_names(path, package) if (owner := _owner(name)) is not None}


MODEL_IMPORTS = {path: _model_imports(path) for path in MODEL_FILES}


@pytest.mark.parametrize("path", MODEL_FILES, ids=lambda path: str(path.relative_to(ROOT)))
def test_models_import_only_the_protocols_and_the_layout(path):
    other = {m for m in MODEL_IMPORTS[path] if not _within(m, MODELS_IMPORT) and m not in MODELS_ALSO_IMPORT}
    assert other == set(), f"{path.relative_to(ROOT)} imports {sorted(other)} from torchtitan_lite"


def test_every_allowed_model_import_is_still_used():
    used = set().union(*MODEL_IMPORTS.values())
    assert len(MODEL_FILES) > 20 and "torchtitan_lite.protocols.model" in used
    assert sorted(set(MODELS_ALSO_IMPORT) - used) == [], "an allowed import no longer needed: delete it"


MAX_FILE_LINES = 450
MAX_FUNCTION_LINES = 80


def test_no_file_or_function_in_the_core_is_too_long():
    offenders = []
    for path in sorted(MODULES.values()):
        source = path.read_text()
        if (lines := len(source.splitlines())) > MAX_FILE_LINES:
            offenders.append(f"{path.relative_to(ROOT)}: {lines} lines (file)")
        for node in ast.walk(ast.parse(source, str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = (node.end_lineno or node.lineno) - node.lineno + 1
                if length > MAX_FUNCTION_LINES:
                    offenders.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name}: {length} lines")
    assert offenders == [], (f"over {MAX_FILE_LINES} lines per file or {MAX_FUNCTION_LINES} per function: "
                             + "; ".join(offenders))


@pytest.mark.parametrize("module", ["torchtitan_lite.components.data.records",
                                    "torchtitan_lite.components.data.sources",
                                    "torchtitan_lite.protocols.model_spec"])
def test_formerly_cyclic_modules_import_first_in_a_fresh_interpreter(module):
    result = subprocess.run([sys.executable, "-c", f"import {module}"], cwd=PACKAGE.parent, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
