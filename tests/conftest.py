"""Wiring for the tests, as train.py does it for a run: importing `models` registers the model families
with the core, which looks them up by name."""
import models  # noqa: F401


def pytest_collection_modifyitems(config, items):
    """Tests marked ``gpu`` (tests/gpu) are collected everywhere and skipped, with the reason, without CUDA."""
    import pytest
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
