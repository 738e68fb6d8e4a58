"""Wiring for the tests, as train.py does it for a run: importing `models` registers the model families
with the core, which looks them up by name.

The tests never touch the network: HF_HUB_OFFLINE is set before huggingface_hub or datasets is imported
(subprocesses inherit it), and hub code paths are tested on local folders and stand-in clients."""
import os
import shutil
import tempfile

import pytest

os.environ["HF_HUB_OFFLINE"] = "1"
# Hermetic: the suite never reads or writes a user's caches (the measured CPU peak, tokenized data, the hub's
# files, compiled kernels); it gets its own, removed when the session ends. Subprocesses inherit these.
_SUITE_CACHE = tempfile.mkdtemp(prefix="ttl-suite-cache-")
os.environ["TORCHTITAN_LITE_CACHE"] = os.path.join(_SUITE_CACHE, "torchtitan_lite")
os.environ["HF_HOME"] = os.path.join(_SUITE_CACHE, "hf")
# inductor's compiled kernels and Triton's too (a user's /tmp/torchinductor_$USER would make compile tests pass on
# kernels built by other code and time them warm): shared by the session's tests and launches, cold at its start,
# as in a fresh CI machine.
os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(_SUITE_CACHE, "inductor")
os.environ["TRITON_CACHE_DIR"] = os.path.join(_SUITE_CACHE, "triton")

import models  # noqa: E402, F401

# As every FP8 run does: a CPU whose torch._scaled_mm is oneDNN's reference kernel (0.04 GFLOP/s) gets one at
# matmul speed before a test builds torchao's Float8Linear directly (torchtitan_lite/cpu_scaled_mm.py).
import torchtitan_lite.compat  # noqa: E402, F401


def pytest_unconfigure(config):
    shutil.rmtree(_SUITE_CACHE, ignore_errors=True)


@pytest.fixture(autouse=True)
def _runs_start_in_their_own_folder(tmp_path, monkeypatch):
    """Every test runs in its own empty working directory, and so does every launch it starts
    (tests/integration/_cli.py): a run that keeps the default --job.dump_folder (./outputs) writes and resumes
    there, never in the checkout's ./outputs, which README command 1 fills."""
    monkeypatch.chdir(tmp_path)


def pytest_collection_modifyitems(config, items):
    """Tests marked ``gpu`` (tests/gpu) are collected everywhere and skipped, with the reason, without CUDA."""
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
