import dataclasses

import pytest
from test_config_toys import QuantConfig, ScaleConfig, ToyTrainer, Training

from torchtitan_lite.components.data.dataloader import TextDataLoader
from torchtitan_lite.config.errors import ConfigError
from torchtitan_lite.config.overrides import Override, apply_overrides, overrides_from_dict


def cli(*pairs: tuple[str, str | None]) -> list[Override]:
    return [Override(key, value) for key, value in pairs]


def apply_cli(*pairs, base=None):
    return apply_overrides(base or ToyTrainer.Config(), cli(*pairs))


def error_of(*pairs, base=None) -> str:
    with pytest.raises(ConfigError) as err:
        apply_cli(*pairs, base=base)
    return str(err.value)


def test_dotted_keys_set_typed_values():
    cfg = apply_cli(
        ("training.steps", "20"),
        ("training.max_norm", "1e-3"),
        ("training.seed", "none"),
        ("training.mode", "full"),
        ("training.components", "model"),
        ("training.sizes", "[1, 2]"),
        ("optimizer.lr", "0.01"),
        ("training.compile", "yes"),
    )
    t = cfg.training
    assert (t.steps, t.max_norm, t.seed, t.mode, t.components, t.sizes, t.compile) == (
        20, 1e-3, None, "full", ["model"], [1, 2], True)
    assert cfg.optimizer.lr == 0.01


def test_three_level_key_reaches_a_section_inside_a_section():
    cfg = apply_cli(("training.schedule.warmup", "7"))
    assert cfg.training.schedule.warmup == 7


def test_bare_bool_flag_means_true():
    assert apply_cli(("training.compile", None)).training.compile is True


def test_missing_value_names_the_flag():
    assert error_of(("training.steps", None)) == (
        "--training.steps needs a value: --training.steps VALUE or --training.steps=VALUE")


def test_later_override_wins():
    assert apply_cli(("training.steps", "5"), ("training.steps", "6")).training.steps == 6


def test_base_config_and_shared_objects_are_not_mutated():
    shared = Training(steps=4)
    base = ToyTrainer.Config(training=shared)
    cfg = apply_cli(("training.steps", "9"), ("training.components", "x"), base=base)
    assert cfg.training.steps == 9 and cfg.training.components == ["x"]
    assert shared.steps == 4 and shared.components == ["model", "loss"]
    assert base.training is shared
    assert Training().components == ["model", "loss"]


def test_unknown_key_suggests_closest_name():
    assert error_of(("training.stpes", "5")) == "unknown key 'training.stpes'; did you mean 'training.steps'?"


def test_unknown_section_suggests_closest_section():
    assert error_of(("trainig.steps", "5")) == (
        "unknown section 'trainig' in --trainig.steps; did you mean 'training'?")


def test_key_in_the_wrong_section_suggests_where_it_lives():
    assert error_of(("training.lr", "1")) == "unknown key 'training.lr'; did you mean 'optimizer.lr'?"


def test_unknown_key_without_close_match_lists_valid_keys():
    assert error_of(("optimizer.zzz", "1")) == "unknown key 'optimizer.zzz'; valid keys of 'optimizer': name, lr, eps"


def test_wrong_type_names_key_and_expected_type():
    assert error_of(("training.steps", "five")) == "--training.steps expects an int, got 'five'"


def test_literal_error_lists_allowed_values():
    assert error_of(("training.mode", "ful")) == (
        "--training.mode expects one of 'none', 'full', 'selective', got 'ful'; did you mean 'full'?")


def test_section_given_a_value_is_rejected_with_example():
    assert error_of(("training.schedule", "3")) == (
        "--training.schedule is a section, not a value; set its fields, e.g. --training.schedule.warmup VALUE")


def test_key_below_a_plain_field_is_rejected():
    assert error_of(("training.steps.x", "3")) == "--training.steps.x: 'training.steps' is a int value, not a section"


def test_post_init_runs_again_and_its_error_names_the_key():
    assert error_of(("training.steps", "0")) == (
        "invalid value for --training.steps: training.steps must be >= 1, got 0")


def test_values_are_validated_only_after_all_overrides():
    # 0 alone is invalid, but the later override fixes it before validation runs.
    assert apply_cli(("training.steps", "0"), ("training.steps", "3")).training.steps == 3


def test_invalid_base_config_is_reported_as_such():
    base = ToyTrainer.Config()
    base.training.steps = 0
    with pytest.raises(ConfigError, match=r"^config 'toy' is invalid: training.steps must be >= 1, got 0$"):
        apply_overrides(base, [], base_label="config 'toy'")


# --- typed-config lists ----------------------------------------------------------------------------


def test_typed_list_from_kind_names_builds_default_entries():
    cfg = apply_cli(("model_converters.converters", "quant,scale"))
    assert cfg.model_converters.converters == [QuantConfig(), ScaleConfig()]


def test_typed_list_entry_field_by_index():
    cfg = apply_cli(
        ("model_converters.converters", "quant"),
        ("model_converters.converters.0.recipe_name", "rowwise"),
        ("model_converters.converters.0.filter_fqns", "output,wq"),
    )
    assert cfg.model_converters.converters == [QuantConfig(recipe_name="rowwise", filter_fqns=["output", "wq"])]


def test_typed_list_empty_string_clears_it():
    base = ToyTrainer.Config()
    base.model_converters.converters = [ScaleConfig()]
    assert apply_cli(("model_converters.converters", ""), base=base).model_converters.converters == []


def test_typed_list_unknown_kind_suggests():
    assert error_of(("model_converters.converters", "quatn")) == (
        "--model_converters.converters: unknown kind 'quatn'; did you mean 'quant'?; kinds: scale, quant")


def test_typed_list_index_out_of_range_says_how_to_add_entries():
    assert error_of(("model_converters.converters.0.recipe_name", "rowwise")) == (
        "--model_converters.converters.0.recipe_name: model_converters.converters has 0 entries, so there is "
        "no entry 0; set the list first (--model_converters.converters KIND,... or "
        "[[model_converters.converters]] tables)")


def test_typed_list_needs_an_index():
    message = error_of(("model_converters.converters", "quant"), ("model_converters.converters.recipe_name", "x"))
    assert "address an entry by index, e.g. --model_converters.converters.0.recipe_name" in message


def test_typed_list_field_of_another_kind_is_unknown():
    assert error_of(("model_converters.converters", "scale"),
                    ("model_converters.converters.0.recipe_name", "rowwise")) == (
        "unknown key 'model_converters.converters.0.recipe_name'; valid keys of "
        "'model_converters.converters.0': enabled, factor")


def test_typed_list_entry_validation_names_the_entry_key():
    assert error_of(("model_converters.converters", "scale"), ("model_converters.converters.0.factor", "-1")) == (
        "invalid value for --model_converters.converters.0.factor: factor must be > 0, got -1.0")


def test_parent_post_init_sees_the_whole_list():
    assert error_of(("model_converters.converters", "scale,scale")) == (
        "invalid value for --model_converters.converters: "
        "model_converters.converters lists a kind twice: ['scale', 'scale']")


# --- overrides from TOML tables ---------------------------------------------------------------------


def apply_toml(data: dict, base=None):
    return apply_overrides(base or ToyTrainer.Config(), overrides_from_dict(data, "over.toml"))


def test_nested_tables_flatten_to_dotted_keys_in_order():
    data = {"training": {"steps": 3, "schedule": {"ratio": 1}}, "optimizer": {"lr": 0.1}}
    assert [(o.key, o.value) for o in overrides_from_dict(data, "f")] == [
        ("training.steps", 3), ("training.schedule.ratio", 1), ("optimizer.lr", 0.1)]


def test_toml_values_are_type_checked_with_the_file_named():
    with pytest.raises(ConfigError) as err:
        apply_toml({"training": {"compile": 1}})
    assert str(err.value) == (
        "training.compile (in over.toml) expects a bool (true/false/yes/no/1/0), got 1 (int)")


def test_toml_unknown_key_names_the_file():
    with pytest.raises(ConfigError) as err:
        apply_toml({"training": {"stpes": 1}})
    assert str(err.value) == "unknown key 'training.stpes' (in over.toml); did you mean 'training.steps'?"


def test_toml_typed_list_tables_with_kind_and_fields():
    data = {"model_converters": {"converters": [
        {"kind": "quant", "recipe_name": "rowwise"}, {"kind": "scale", "factor": 3}]}}
    cfg = apply_toml(data)
    assert cfg.model_converters.converters == [QuantConfig(recipe_name="rowwise"), ScaleConfig(factor=3.0)]


def test_toml_typed_list_of_kind_names():
    cfg = apply_toml({"model_converters": {"converters": ["scale"]}})
    assert cfg.model_converters.converters == [ScaleConfig()]


def test_toml_typed_list_entry_without_kind():
    with pytest.raises(ConfigError) as err:
        apply_toml({"model_converters": {"converters": [{"factor": 3}]}})
    assert str(err.value) == (
        "model_converters.converters (in over.toml): entry 0 needs a kind = ... key (one of scale, quant)")


def test_toml_typed_list_entry_field_error_names_index_and_file():
    with pytest.raises(ConfigError) as err:
        apply_toml({"model_converters": {"converters": [{"kind": "quant", "recipe_name": "colwise"}]}})
    assert str(err.value) == (
        "model_converters.converters.0.recipe_name (in over.toml) expects one of 'tensorwise', 'rowwise', "
        "got 'colwise' (str); did you mean 'rowwise'?")


def test_toml_section_given_a_value():
    with pytest.raises(ConfigError) as err:
        apply_toml({"training": 3})
    assert str(err.value) == "training (in over.toml) is a section, not a value; set its fields, in a [training] table"


@dataclasses.dataclass
class _DataRoot:
    data: TextDataLoader.Config = dataclasses.field(default_factory=lambda: TextDataLoader.Config(
        dataset="HuggingFaceFW/fineweb-edu", dataset_config="sample-10BT", streaming=True, shuffle="none"))


@pytest.mark.parametrize("overrides, dataset_config", [
    # Replacing the dataset drops the base's configuration name: it described the base's dataset.
    ([Override("data.dataset", "embedded")], None),
    ([Override("data.dataset", "embedded", "run.toml")], None),
    # Set along with the dataset (in either order) or later, it is kept.
    ([Override("data.dataset", "allenai/c4"), Override("data.dataset_config", "en")], "en"),
    ([Override("data.dataset_config", "en"), Override("data.dataset", "allenai/c4")], "en"),
    ([Override("data.dataset", "allenai/c4", "run.toml"), Override("data.dataset_config", "en")], "en"),
    # A later origin that replaces the dataset alone resets what an earlier one set.
    ([Override("data.dataset", "allenai/c4", "run.toml"), Override("data.dataset_config", "en", "run.toml"),
      Override("data.dataset", "embedded")], None),
    # The same dataset restated is no replacement.
    ([Override("data.dataset", "HuggingFaceFW/fineweb-edu")], "sample-10BT"),
    ([Override("data.streaming", "false"), Override("data.shuffle", "windows")], "sample-10BT"),
])
def test_a_field_that_belongs_to_another_is_reset_when_its_owner_is_replaced_alone(overrides, dataset_config):
    assert apply_overrides(_DataRoot(), overrides).data.dataset_config == dataset_config
