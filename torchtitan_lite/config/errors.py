"""The one error type of the config system, and the "did you mean" suggestions it carries."""
from __future__ import annotations

import difflib
from collections.abc import Iterable


class ConfigError(ValueError):
    """A config name, key, type or value was rejected; the message names it and the fix."""


def closest(word: str, candidates: Iterable[str], *, n: int = 3) -> list[str]:
    """The candidates that look most like ``word`` (difflib ratio >= 0.6), best first."""
    return difflib.get_close_matches(word, list(candidates), n=n, cutoff=0.6)


def did_you_mean(suggestions: list[str]) -> str:
    """``"; did you mean 'a' or 'b'?"`` for a non-empty list, else an empty string."""
    if not suggestions:
        return ""
    return "; did you mean " + " or ".join(f"'{s}'" for s in suggestions) + "?"
