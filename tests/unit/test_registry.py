import re
import sys
import textwrap
import types
from dataclasses import dataclass
from pathlib import Path

import pytest

import config_registry
from config_registry import ConfigRegistry
from torchtitan_lite.config import list_configs_text
from torchtitan_lite.config.errors import ConfigError


@dataclass
class Cfg:
    steps: int = 1
    tags: list | None = None


def llama3_debug() -> Cfg:
    """Small debug model.

    More text that --list-configs does not show.
    """
    return Cfg(steps=2, tags=[])


def llama3_8b() -> Cfg:
    """Big model."""
    return Cfg(steps=3)


def undocumented() -> Cfg:
    return Cfg()


@pytest.fixture
def registry() -> ConfigRegistry:
    reg = ConfigRegistry(package=None)
    for fn in (llama3_debug, llama3_8b, undocumented):
        reg.register(fn)
    return reg


def test_get_calls_the_function_each_time(registry):
    first, second = registry.get("llama3_debug"), registry.get("llama3_debug")
    assert first == Cfg(steps=2, tags=[]) and first is not second and first.tags is not second.tags


def test_names_are_sorted(registry):
    assert registry.names() == ["llama3_8b", "llama3_debug", "undocumented"]


def test_describe_gives_first_docstring_sentence(registry):
    assert registry.describe() == [("llama3_8b", "Big model."), ("llama3_debug", "Small debug model."),
                                   ("undocumented", "")]


def wrapped() -> Cfg:
    """A first sentence that the source wraps (1.5B params, e.g. wq and wo) over
    two lines. A second sentence --list-configs leaves out."""
    return Cfg()


def test_a_wrapped_first_sentence_is_shown_whole():
    reg = ConfigRegistry(package=None)
    reg.register(wrapped)
    assert reg.describe() == [("wrapped", "A first sentence that the source wraps (1.5B params, e.g. wq and wo) over "
                                          "two lines.")]


def test_every_listed_config_description_is_a_whole_sentence():
    for name, doc in config_registry.describe():
        assert doc.endswith((".", "!", "?")), f"{name}: {doc!r} stops mid-sentence"
        # Short enough to read as one line of --list-configs: a longer first sentence belongs in a second one.
        assert len(doc) <= 240, f"{name}: the first sentence of its docstring has {len(doc)} characters"


def test_unknown_name_suggests_and_points_to_list_configs(registry):
    with pytest.raises(ConfigError) as err:
        registry.get("llama3_debgu")
    assert str(err.value) == (
        "unknown config 'llama3_debgu'; did you mean 'llama3_debug'?; run with --list-configs to see them all")


def test_unknown_name_without_close_match_lists_names(registry):
    with pytest.raises(ConfigError) as err:
        registry.get("gpt")
    assert str(err.value) == ("unknown config 'gpt' (known: llama3_8b, llama3_debug, undocumented); "
                              "run with --list-configs to see them all")


def test_duplicate_name_is_an_error_naming_both(registry):
    def llama3_8b() -> Cfg:  # noqa: F811 - the clash is the point
        return Cfg()

    with pytest.raises(ConfigError) as err:
        registry.register(llama3_8b)
    assert str(err.value) == (
        "config 'llama3_8b' is registered twice (test_registry.llama3_8b and "
        "test_registry.test_duplicate_name_is_an_error_naming_both.<locals>.llama3_8b); rename one of them")


def test_function_must_return_a_dataclass():
    reg = ConfigRegistry(package=None)

    @reg.register
    def broken():
        return {"steps": 1}

    with pytest.raises(ConfigError, match=r"returned dict, not a config dataclass"):
        reg.get("broken")


def test_registered_context_removes_functions_afterwards(registry):
    def temp() -> Cfg:
        return Cfg(steps=9)

    with registry.registered(temp):
        assert registry.get("temp").steps == 9
    assert "temp" not in registry.names()
    registry.unregister("undocumented")
    assert registry.names() == ["llama3_8b", "llama3_debug"]


TOY_MODULE = textwrap.dedent("""
    from dataclasses import dataclass
    from {package} import REGISTRY

    @dataclass
    class C:
        x: int = 0

    @REGISTRY.register
    def {name}() -> C:
        \"\"\"{name} doc.\"\"\"
        return C()
""")


def test_every_module_of_the_package_is_imported_on_first_use(tmp_path, monkeypatch):
    package = tmp_path / "ttl_toy_configs"
    package.mkdir()
    (package / "__init__.py").write_text(
        "from config_registry import ConfigRegistry\nREGISTRY = ConfigRegistry(__name__)\n")

    (package / "family_a.py").write_text(TOY_MODULE.format(package=package.name, name="alpha"))
    (package / "family_b.py").write_text(TOY_MODULE.format(package=package.name, name="beta"))
    (package / "_helpers.py").write_text("raise RuntimeError('private modules are not imported')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        import ttl_toy_configs

        assert "ttl_toy_configs.family_a" not in sys.modules
        assert ttl_toy_configs.REGISTRY.describe() == [("alpha", "alpha doc."), ("beta", "beta doc.")]
    finally:
        for name in [m for m in sys.modules if m.startswith("ttl_toy_configs")]:
            del sys.modules[name]


def test_module_level_functions_use_the_package_registry(monkeypatch):
    monkeypatch.setattr(config_registry, "DEFAULT_REGISTRY", ConfigRegistry(package=None))
    config_registry.register(llama3_8b)
    with config_registry.registered(llama3_debug):
        assert config_registry.names() == ["llama3_8b", "llama3_debug"]
        assert config_registry.get("llama3_debug") == Cfg(steps=2, tags=[])
    assert config_registry.describe() == [("llama3_8b", "Big model.")]
    config_registry.unregister("llama3_8b")
    assert config_registry.names() == []




@pytest.fixture
def registry_with_broken_files(tmp_path, monkeypatch):
    """A package of one good config file and three broken ones: a syntax error, a missing import and an
    exception after one of its configs was registered."""
    # Outside the working directory, so the messages name the files by their absolute paths.
    package = tmp_path / "lib" / "ttl_broken_configs"
    package.mkdir(parents=True)
    (tmp_path / "work").mkdir()
    monkeypatch.chdir(tmp_path / "work")
    (package / "__init__.py").write_text(
        "from config_registry import ConfigRegistry\nREGISTRY = ConfigRegistry(__name__)\n")
    (package / "good.py").write_text(TOY_MODULE.format(package=package.name, name="alpha"))
    (package / "syntax.py").write_text("def beta(:\n    pass\n")
    (package / "missing.py").write_text("import ttl_no_such_module\n\n\ndef gamma():\n    pass\n")
    (package / "raises.py").write_text(TOY_MODULE.format(package=package.name, name="delta")
                                       + "\nraise ValueError('bad value in my config file')\n")
    monkeypatch.syspath_prepend(str(tmp_path / "lib"))
    import ttl_broken_configs

    yield ttl_broken_configs.REGISTRY, package
    for name in [m for m in sys.modules if m.startswith("ttl_broken_configs")]:
        del sys.modules[name]


def test_a_broken_config_file_is_reported_and_the_others_still_work(registry_with_broken_files):
    registry, package = registry_with_broken_files
    assert registry.describe() == [("alpha", "alpha doc.")]  # delta, registered before its file raised, is dropped
    assert [(b.path, b.error) for b in registry.broken_modules()] == [
        (str(package / "missing.py"), "ModuleNotFoundError at line 1: No module named 'ttl_no_such_module'"),
        (str(package / "raises.py"), "ValueError at line 14: bad value in my config file"),
        (str(package / "syntax.py"), "SyntaxError at line 1: invalid syntax"),
    ]
    assert registry.get("alpha").x == 0
    assert list_configs_text(registry).splitlines() == [
        "alpha  alpha doc.",
        f"warning: {package / 'missing.py'} fails to import, its configs are not available: "
        "ModuleNotFoundError at line 1: No module named 'ttl_no_such_module'",
        f"warning: {package / 'raises.py'} fails to import, its configs are not available: "
        "ValueError at line 14: bad value in my config file",
        f"warning: {package / 'syntax.py'} fails to import, its configs are not available: "
        "SyntaxError at line 1: invalid syntax",
    ]


@pytest.mark.parametrize("name, file, error", [
    ("beta", "syntax.py", "SyntaxError at line 1: invalid syntax"),
    ("gamma", "missing.py", "ModuleNotFoundError at line 1: No module named 'ttl_no_such_module'"),
    ("delta", "raises.py", "ValueError at line 14: bad value in my config file"),
])
def test_a_config_of_a_broken_file_is_an_error_naming_the_file_and_its_error(registry_with_broken_files, name,
                                                                            file, error):
    registry, package = registry_with_broken_files
    with pytest.raises(ConfigError) as err:
        registry.get(name)
    assert str(err.value) == (f"config '{name}' is defined in {package / file}, which fails to import: {error}; "
                              "fix that file (the configs of the other files still work)")


def test_an_unknown_config_names_the_files_that_failed_to_import(registry_with_broken_files):
    registry, package = registry_with_broken_files
    with pytest.raises(ConfigError) as err:
        registry.get("omega")
    message = str(err.value)
    assert message.startswith("unknown config 'omega' (known: alpha); run with --list-configs to see them all; ")
    assert (f"; {package / 'syntax.py'} fails to import (SyntaxError at line 1: invalid syntax): a config there is "
            "not available until it is fixed") in message


def test_a_working_config_warns_once_about_the_broken_files(registry_with_broken_files, caplog):
    registry, package = registry_with_broken_files
    with caplog.at_level("WARNING", logger="torchtitan_lite.config.registry"):
        registry.get("alpha")
        registry.get("alpha")
    assert [r.getMessage() for r in caplog.records] == [
        f"{package / f} fails to import, its configs are not available: {e}" for f, e in [
            ("missing.py", "ModuleNotFoundError at line 1: No module named 'ttl_no_such_module'"),
            ("raises.py", "ValueError at line 14: bad value in my config file"),
            ("syntax.py", "SyntaxError at line 1: invalid syntax")]]


def test_the_readme_registry_example_runs_as_written():
    # Saved as a file of config_registry/, the README's example registers a config that builds.
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    (example,) = [block for block in re.findall(r"```python\n(.*?)```", readme, flags=re.S)
                  if "def llama3_debug_fp8_rowwise_ac" in block]
    module = types.ModuleType("config_registry.readme_example")
    try:
        exec(compile(example, "README.md", "exec"), module.__dict__)
        config = config_registry.get("llama3_debug_fp8_rowwise_ac")
    finally:
        config_registry.DEFAULT_REGISTRY.unregister("llama3_debug_fp8_rowwise_ac")
    assert config.activation_checkpoint.mode == "selective"
    assert config.model_converters == config_registry.get("llama3_debug_fp8_rowwise").model_converters


def test_the_readme_mixture_example_runs_as_written():
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    (example,) = [block for block in re.findall(r"```python\n(.*?)```", readme, flags=re.S)
                  if "def llama3_debug_mixture" in block]
    module = types.ModuleType("config_registry.readme_mixture_example")
    try:
        exec(compile(example, "README.md", "exec"), module.__dict__)
        config = config_registry.get("llama3_debug_mixture")
    finally:
        config_registry.DEFAULT_REGISTRY.unregister("llama3_debug_mixture")
    assert [(s.name, s.weight) for s in config.data.sources] == [("code", 3), ("prose", 1)]
    assert config.data.source_config(1).token_store == "data/prose-tokens"
