import pytest
from test_config_toys import QuantConfig, ToyTrainer

from config_registry import ConfigRegistry
from torchtitan_lite.config.cli import ACTIONS, list_configs_text, main_help_text, parse_cli
from torchtitan_lite.config.errors import ConfigError
from torchtitan_lite.config.toml_io import config_to_toml


def toy_debug() -> ToyTrainer.Config:
    """Toy debug run; the default here."""
    cfg = ToyTrainer.Config()
    cfg.training.steps = 100
    return cfg


def toy_quant() -> ToyTrainer.Config:
    """toy_debug with a quant converter."""
    cfg = toy_debug()
    cfg.model_converters.converters = [QuantConfig()]
    return cfg


@pytest.fixture
def registry() -> ConfigRegistry:
    reg = ConfigRegistry(package=None)
    reg.register(toy_debug)
    reg.register(toy_quant)
    return reg


@pytest.fixture
def parse(registry):
    return lambda *argv: parse_cli(list(argv), default_config="toy_debug", registry=registry)


def error_of(parse, *argv) -> str:
    with pytest.raises(ConfigError) as err:
        parse(*argv)
    return str(err.value)


def test_actions_are_the_documented_set():
    assert set(ACTIONS) == {"train", "help", "print_config", "list_configs", "print_fp8_plan", "estimate_memory",
                            "check_config", "dry_run", "dry_run_detail"}


def test_default_config_and_train_action(parse):
    result = parse()
    assert (result.action, result.config_name, result.config) == ("train", "toy_debug", toy_debug())


def test_config_flag_selects_registered_config(parse):
    assert parse("--config", "toy_quant").config == toy_quant()
    assert parse("--config=toy_quant").config_name == "toy_quant"


def test_layers_registry_then_file_then_flags(parse, tmp_path):
    path = tmp_path / "over.toml"
    path.write_text("[training]\nsteps = 5\nmax_norm = 0.5\n[optimizer]\nlr = 0.1\n")
    cfg = parse("--training.steps", "6", "--config-file", str(path), "--optimizer.lr=0.2").config
    assert (cfg.training.steps, cfg.training.max_norm, cfg.optimizer.lr) == (6, 0.5, 0.2)
    assert cfg.optimizer.eps == 1e-8  # untouched by any layer


def test_printed_config_loaded_as_config_file_reproduces_it(parse, tmp_path):
    cfg = parse("--config", "toy_quant", "--model_converters.converters.0.recipe_name", "rowwise",
                "--training.seed", "null", "--training.sizes", "1,2").config
    path = tmp_path / "config.toml"
    path.write_text(config_to_toml(cfg))
    assert parse("--config-file", str(path)).config == cfg


def test_flag_values_in_both_forms_and_bare_bools(parse):
    cfg = parse("--training.compile", "--training.max_norm", "-1", "--training.tag=a=b",
                "--training.components=", "--model_converters.print_after_conversion").config
    t = cfg.training
    assert (t.compile, t.max_norm, t.tag, t.components) == (True, -1.0, "a=b", [])
    assert cfg.model_converters.print_after_conversion is True


def test_typed_list_from_the_command_line(parse):
    cfg = parse("--model_converters.converters", "quant", "--model_converters.converters.0.filter_fqns",
                "output").config
    assert cfg.model_converters.converters == [QuantConfig(filter_fqns=["output"])]


def test_help_needs_no_valid_config(parse):
    result = parse("--config", "nope", "--bogus", "--training.steps", "x", "-h")
    assert (result.action, result.config) == ("help", None)
    assert parse("--help").action == "help"


def test_list_configs_needs_no_config(parse, registry):
    assert parse("--list-configs").action == "list_configs"
    assert list_configs_text(registry) == (
        "toy_debug  Toy debug run; the default here.\n"
        "toy_quant  toy_debug with a quant converter.")


@pytest.mark.parametrize("flag, action", [("--print-config", "print_config"), ("--print-fp8-plan", "print_fp8_plan"),
                                          ("--estimate-memory", "estimate_memory")])
def test_inspection_actions_carry_the_resolved_config(parse, flag, action):
    result = parse(flag, "--training.steps", "3")
    assert result.action == action and result.config.training.steps == 3


def test_two_actions_are_refused(parse):
    assert error_of(parse, "--print-config", "--estimate-memory") == (
        "choose one action, got --print-config and --estimate-memory")


def test_action_flag_takes_no_value(parse):
    assert error_of(parse, "--print-config=yes") == "--print-config takes no value, got 'yes'"


def test_unknown_flag_lists_valid_flags(parse):
    assert error_of(parse, "--foo") == (
        "unknown flag '--foo'; valid flags: --help, --config, --config-file, --nnodes, --list-configs, --print-config, "
        "--print-fp8-plan, --estimate-memory, --check-config, --dry-run, --dry-run-detail, and --section.field VALUE to "
        "set a config "
        "field (see --help)")
    assert error_of(parse, "--confg", "x").startswith("unknown flag '--confg'; did you mean '--config'?")


def test_nnodes_must_be_a_positive_integer(parse):
    assert parse("--nnodes", "4", "--dry-run").nnodes == 4
    assert parse("--check-config").nnodes == 1
    assert error_of(parse, "--nnodes", "0", "--dry-run") == "--nnodes expects a positive integer, got '0'"


def test_missing_values_name_the_flag(parse):
    assert error_of(parse, "--config", "--training.steps", "3") == "--config needs a value: --config NAME"
    assert error_of(parse, "--config-file") == "--config-file needs a value: --config-file FILE"
    assert error_of(parse, "--training.steps") == (
        "--training.steps needs a value: --training.steps VALUE or --training.steps=VALUE")


def test_stray_argument_and_malformed_flag(parse):
    assert error_of(parse, "--training.compile", "true", "extra").startswith("unexpected argument 'extra'")
    assert error_of(parse, "--training.") == "malformed flag '--training.': expected --section.field"


def test_config_given_twice(parse):
    assert error_of(parse, "--config", "toy_debug", "--config", "toy_quant") == (
        "--config is given twice ('toy_debug' and 'toy_quant'); give it once")


def test_unknown_config_name(parse):
    assert error_of(parse, "--config", "toy_qaunt") == (
        "unknown config 'toy_qaunt'; did you mean 'toy_quant'?; run with --list-configs to see them all")


def test_bad_override_is_reported_with_the_flag(parse):
    assert error_of(parse, "--training.steps", "five") == "--training.steps expects an int, got 'five'"
    assert error_of(parse, "--training.steps", "0") == (
        "invalid value for --training.steps: training.steps must be >= 1, got 0")


def test_missing_config_file_is_named(parse, tmp_path):
    missing = tmp_path / "missing.toml"
    assert error_of(parse, "--config-file", str(missing)) == f"config file '{missing}' not found"


def test_main_help_text_lists_flags_and_fields():
    text = main_help_text(ToyTrainer.Config)
    assert text.startswith("usage: train.py [--config NAME] [--config-file FILE] [--section.field VALUE ...] [ACTION]")
    for flag in ("-h, --help", "--config NAME", "--config-file FILE", "--list-configs", "--print-config",
                 "--print-fp8-plan", "--estimate-memory"):
        assert f"\n  {flag} " in text
    assert "\n  --training.steps  int  (default: 10)  Optimizer steps.\n" in text


def test_help_after_config_shows_its_values_beside_the_defaults():
    import config_registry
    from torchtitan_lite.trainer import Trainer

    registry = config_registry.DEFAULT_REGISTRY
    cli = parse_cli(["--config", "llama3_debug_fp8", "--help"], registry=registry)
    assert (cli.action, cli.help_config) == ("help", "llama3_debug_fp8")
    text = main_help_text(Trainer.Config, registry.get(cli.help_config), cli.help_config)
    assert "--training.steps  int  (default: 300, llama3_debug_fp8: 200)  " in text
    assert "(default: [], llama3_debug_fp8: [float8])" in text
    assert "--training.max_norm  float  (default: 1.0)  " in text  # equal values show once
    assert parse_cli(["--help"], registry=registry).help_config is None
