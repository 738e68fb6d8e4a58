"""transformers for the tests that hold our models against Hugging Face's (the only tests that catch MLA, YaRN
and expert-order bugs): outside CI its absence skips them; in CI (``CI=true``, where the ``test`` extra installs
it) its absence fails them, so that a broken install cannot turn them into silent skips."""
from __future__ import annotations

import importlib
import os
from types import ModuleType

import pytest


def in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() in ("1", "true", "yes")


def import_transformers() -> ModuleType:
    if not in_ci():
        return pytest.importorskip("transformers")
    try:
        return importlib.import_module("transformers")
    except ImportError as e:
        problem = str(e)
    pytest.fail(f"CI=true but transformers does not import ({problem}): install the test extra "
                f"(pip install -e '.[test]'); outside CI these tests skip", pytrace=False)
