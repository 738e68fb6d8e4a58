import sys
import textwrap
from dataclasses import dataclass

import pytest

import config_registry
from config_registry import ConfigRegistry
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


def test_describe_gives_first_docstring_line(registry):
    assert registry.describe() == [("llama3_8b", "Big model."), ("llama3_debug", "Small debug model."),
                                   ("undocumented", "")]


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


def test_every_module_of_the_package_is_imported_on_first_use(tmp_path, monkeypatch):
    package = tmp_path / "ttl_toy_configs"
    package.mkdir()
    (package / "__init__.py").write_text(
        "from config_registry import ConfigRegistry\nREGISTRY = ConfigRegistry(__name__)\n")
    module = textwrap.dedent("""
        from dataclasses import dataclass
        from ttl_toy_configs import REGISTRY

        @dataclass
        class C:
            x: int = 0

        @REGISTRY.register
        def {name}() -> C:
            \"\"\"{name} doc.\"\"\"
            return C()
    """)
    (package / "family_a.py").write_text(module.format(name="alpha"))
    (package / "family_b.py").write_text(module.format(name="beta"))
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
