"""The one error type of the config system, and the "did you mean" suggestions it carries."""
from __future__ import annotations

import difflib
from collections.abc import Iterable


class ConfigError(ValueError):
    """A config name, key, type or value was rejected; the message names it and the fix."""


def closest(word: str, candidates: Iterable[str], *, n: int = 3) -> list[str]:
    """The candidates that look most like ``word``, best first.

    difflib ratio >= 0.6, and within 0.1 of the best match so a clear winner comes alone.
    """
    scored = sorted(
        ((difflib.SequenceMatcher(None, word, c).ratio(), c) for c in dict.fromkeys(candidates)),
        key=lambda sc: -sc[0],
    )
    scored = [(score, c) for score, c in scored if score >= 0.6]
    return [c for score, c in scored[:n] if score >= scored[0][0] - 0.1]


def did_you_mean(suggestions: list[str]) -> str:
    """``"; did you mean 'a' or 'b'?"`` for a non-empty list, else an empty string."""
    if not suggestions:
        return ""
    return "; did you mean " + " or ".join(f"'{s}'" for s in suggestions) + "?"
