"""Wiring for the tests, as train.py does it for a run: importing `models` registers the model families
with the core, which looks them up by name.

The tests never touch the network: HF_HUB_OFFLINE is set before huggingface_hub or datasets is imported
(subprocesses inherit it), and hub code paths are tested on local folders and stand-in clients."""
import os

os.environ["HF_HUB_OFFLINE"] = "1"

import models  # noqa: E402, F401


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
