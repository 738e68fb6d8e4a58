from typing import Literal

import pytest

from torchtitan_lite.config.errors import ConfigError
from torchtitan_lite.config.values import from_cli_text, from_toml_value, split_list_text


@pytest.mark.parametrize("text", ["true", "True", "YES", "1"])
def test_cli_bool_true_words(text):
    assert from_cli_text(text, bool, "--a.b") is True


@pytest.mark.parametrize("text", ["false", "No", "0"])
def test_cli_bool_false_words(text):
    assert from_cli_text(text, bool, "--a.b") is False


@pytest.mark.parametrize(
    "text, tp, expected",
    [
        ("42", int, 42),
        ("-1", int, -1),
        ("1e-3", float, 1e-3),
        ("3", float, 3.0),
        ("hello", str, "hello"),
        ("none", int | None, None),
        ("NULL", float | None, None),
        ("7", int | None, 7),
        ("full", Literal["none", "full"], "full"),
        ("2", Literal[1, 2], 2),
        ("a,b", list[str], ["a", "b"]),
        ("[a, b]", list[str], ["a", "b"]),
        ('["a", "b"]', list[str], ["a", "b"]),
        ("", list[str], []),
        ("[]", list[int], []),
        ("1, 2,3", list[int], [1, 2, 3]),
        ("0.5,1e2", list[float], [0.5, 100.0]),
        ("3", int | str, 3),  # most specific member first
        ("op", int | str, "op"),
    ],
)
def test_cli_text_conversion(text, tp, expected):
    value = from_cli_text(text, tp, "--a.b")
    assert value == expected and type(value) is type(expected)


@pytest.mark.parametrize(
    "text, tp, message",
    [
        ("five", int, "--training.steps expects an int, got 'five'"),
        ("1.5", int, "--training.steps expects an int, got '1.5'"),
        ("fast", float, "--training.steps expects a float, got 'fast'"),
        ("maybe", bool, "--training.steps expects a bool (true/false/yes/no/1/0), got 'maybe'"),
        ("x", int | None, "--training.steps expects an int or none, got 'x'"),
        ("ful", Literal["none", "full", "selective"],
         "--training.steps expects one of 'none', 'full', 'selective', got 'ful'; did you mean 'full'?"),
        ("1,x", list[int], "--training.steps expects a list of int, got '1,x'"),
    ],
)
def test_cli_text_errors_name_key_and_type(text, tp, message):
    with pytest.raises(ConfigError) as err:
        from_cli_text(text, tp, "--training.steps")
    assert str(err.value) == message


def test_none_is_not_accepted_for_a_required_value():
    with pytest.raises(ConfigError, match="expects an int, got 'none'"):
        from_cli_text("none", int, "--a.b")


@pytest.mark.parametrize(
    "value, tp, expected",
    [
        (True, bool, True),
        (3, int, 3),
        (3, float, 3.0),  # TOML int accepted for a float field
        (2.5, float, 2.5),
        ("x", str, "x"),
        ("none", int | None, None),
        ("rowwise", Literal["tensorwise", "rowwise"], "rowwise"),
        ([1, 2], list[int], [1, 2]),
        ([1, 2.5], list[float], [1.0, 2.5]),
        ([], list[str], []),
    ],
)
def test_toml_values_are_checked(value, tp, expected):
    result = from_toml_value(value, tp, "a.b (in f.toml)")
    assert result == expected and type(result) is type(expected)


@pytest.mark.parametrize(
    "value, tp, message",
    [
        (True, int, "a.b (in f.toml) expects an int, got True (bool)"),
        (False, float, "a.b (in f.toml) expects a float, got False (bool)"),
        ("5", int, "a.b (in f.toml) expects an int, got '5' (str)"),
        (1.5, int, "a.b (in f.toml) expects an int, got 1.5 (float)"),
        (1, bool, "a.b (in f.toml) expects a bool (true/false/yes/no/1/0), got 1 (int)"),
        ("a,b", list[str], "a.b (in f.toml) expects a list of str, got 'a,b' (str)"),
        ([1, "x"], list[int], "a.b (in f.toml) expects a list of int, got [1, 'x'] (list)"),
        ("rowwize", Literal["tensorwise", "rowwise"],
         "a.b (in f.toml) expects one of 'tensorwise', 'rowwise', got 'rowwize' (str); did you mean 'rowwise'?"),
    ],
)
def test_toml_type_errors(value, tp, message):
    with pytest.raises(ConfigError) as err:
        from_toml_value(value, tp, "a.b (in f.toml)")
    assert str(err.value) == message


def test_split_list_text_strips_brackets_quotes_and_spaces():
    assert split_list_text(" [ 'a' , b ] ") == ["a", "b"]
    assert split_list_text("   ") == []
