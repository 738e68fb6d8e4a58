"""The command line rejects bad input before any work starts, naming the problem and the fix."""
from __future__ import annotations


def test_misspelled_config_name_suggests_the_right_one(cli):
    result = cli(["--config", "llama3_debgu"])
    assert result.returncode == 2
    assert "llama3_debgu" in result.stderr and "did you mean 'llama3_debug'" in result.stderr


def test_misspelled_key_names_the_valid_key(cli):
    result = cli(["--training.stpes", "5"])
    assert result.returncode == 2
    assert "training.stpes" in result.stderr and "training.steps" in result.stderr


def test_badly_typed_value_names_the_expected_type(cli):
    result = cli(["--training.steps", "five"])
    assert result.returncode == 2
    assert "--training.steps" in result.stderr and "int" in result.stderr and "'five'" in result.stderr


def test_overrides_are_honoured_in_print_config(cli):
    result = cli(["--config", "llama3_debug", "--training.steps", "5", "--optimizer.lr", "1e-3", "--print-config"])
    assert result.returncode == 0, result.stderr
    assert "steps = 5\n" in result.stdout
    assert "lr = 0.001\n" in result.stdout


def test_list_configs_names_every_registered_config_with_a_description(cli):
    import config_registry

    result = cli(["--list-configs"])
    assert result.returncode == 0, result.stderr
    lines = {line.split()[0]: line for line in result.stdout.splitlines() if line.strip()}
    for name in config_registry.names():
        assert name in lines and len(lines[name].split()) > 2, name
