import pytest
from test_config_toys import QuantConfig, ScaleConfig, ToyTrainer

from torchtitan_lite.config.errors import ConfigError
from torchtitan_lite.config.overrides import apply_overrides, overrides_from_dict
from torchtitan_lite.config.toml_io import config_to_dict, config_to_toml, load_toml_overrides, tomllib


def unusual_config() -> ToyTrainer.Config:
    """Every field away from its default, including None where the default is not None and back."""
    cfg = ToyTrainer.Config()
    t = cfg.training
    t.steps, t.max_norm, t.seed, t.tag, t.mode = 7, 1e-8, None, 'quote " back\\slash\nnew line\ttab é', "full"
    t.components, t.sizes, t.factors, t.compile = [], [1, -2], [float("inf"), 2.5], True
    t.schedule.warmup, t.schedule.ratio = 0, 1e20
    cfg.optimizer.lr = 3  # an int in a float field compares equal to the 3.0 read back
    cfg.model_converters.converters = [
        QuantConfig(recipe_name="rowwise", filter_fqns=["output"], enabled=False),
        ScaleConfig(factor=0.25),
    ]
    cfg.model_converters.print_after_conversion = True
    return cfg


def load_onto(text: str, base, tmp_path):
    path = tmp_path / "config.toml"
    path.write_text(text)
    return apply_overrides(base, overrides_from_dict(load_toml_overrides(str(path)), str(path)))


def test_round_trip_through_config_file_is_exact(tmp_path):
    cfg = unusual_config()
    assert load_onto(config_to_toml(cfg), ToyTrainer.Config(), tmp_path) == cfg


def test_round_trip_of_defaults_onto_a_different_config(tmp_path):
    # Written None and the empty typed list must overwrite whatever the base holds.
    default = ToyTrainer.Config()
    assert load_onto(config_to_toml(default), unusual_config(), tmp_path) == default


def test_toml_layout():
    text = config_to_toml(unusual_config())
    assert text.startswith("[training]\nsteps = 7\nmax_norm = 1e-08\n# seed = None (unset)\n")
    assert 'factors = [inf, 2.5]' in text
    assert "\n[training.schedule]\nwarmup = 0\nratio = 1e+20\n" in text
    assert ('\n[model_converters]\nprint_after_conversion = true\n\n'
            '[[model_converters.converters]]\nkind = "quant"\n') in text
    assert '\n[[model_converters.converters]]\nkind = "scale"\nenabled = true\nfactor = 0.25\n' in text


def test_empty_typed_list_is_written_as_empty_array():
    assert "\n[model_converters]\nconverters = []\n" in config_to_toml(ToyTrainer.Config())


def test_output_is_valid_toml_with_every_field(tmp_path):
    text = config_to_toml(unusual_config())
    data = tomllib.loads(text)
    assert data["training"]["tag"] == 'quote " back\\slash\nnew line\ttab é'
    assert "seed" not in data["training"]  # None has no TOML value: it is a comment
    path = tmp_path / "config.toml"
    path.write_text(text)
    read = load_toml_overrides(str(path))
    assert set(read["training"]) == set(config_to_dict(ToyTrainer.Config())["training"])
    assert read["training"]["seed"] == "none"


def test_every_registered_config_loads_back_identically_onto_another(tmp_path):
    import config_registry
    from torchtitan_lite.components.checkpoint.run_config import load_config_file

    names = config_registry.DEFAULT_REGISTRY.names()
    for name, other in zip(names, names[1:] + names[:1]):
        cfg = config_registry.get(name)
        path = tmp_path / f"{name}.toml"
        path.write_text(config_to_toml(cfg))
        assert load_config_file(path, registry=config_registry.DEFAULT_REGISTRY, base=other) == cfg, name


def test_files_of_older_versions_with_none_strings_still_load(tmp_path):
    assert load_onto('[training]\nseed = "none"\n', unusual_config().__class__(), tmp_path).training.seed is None


def test_config_to_dict_keeps_none_and_writes_kinds():
    d = config_to_dict(unusual_config())
    assert d["training"]["seed"] is None
    assert d["training"]["schedule"] == {"warmup": 0, "ratio": 1e20}
    assert d["model_converters"]["converters"] == [
        {"kind": "quant", "enabled": False, "recipe_name": "rowwise", "filter_fqns": ["output"]},
        {"kind": "scale", "enabled": True, "factor": 0.25},
    ]


def test_optional_string_that_reads_back_as_none_is_refused():
    cfg = ToyTrainer.Config()
    cfg.training.tag = "None"
    with pytest.raises(ConfigError, match=r"^training.tag='None' cannot be written as TOML"):
        config_to_toml(cfg)


def test_missing_file_is_named(tmp_path):
    path = tmp_path / "nope.toml"
    with pytest.raises(ConfigError) as err:
        load_toml_overrides(str(path))
    assert str(err.value) == f"config file '{path}' not found"


def test_bad_toml_names_file_and_line(tmp_path):
    path = tmp_path / "bad.toml"
    path.write_text("[training]\nsteps = 5\nseed = = 3\n")
    with pytest.raises(ConfigError) as err:
        load_toml_overrides(str(path))
    assert str(err.value).startswith(f"config file '{path}' is not valid TOML: ")
    assert "line 3" in str(err.value)
