"""Weights & Biases logging (offline): the same scalars as TensorBoard, and a clear error without the package."""
from __future__ import annotations

import importlib.util
import os

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from torchtitan_lite.components.metrics import MetricsProcessor


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_wandb_gets_the_tensorboard_scalars(tmp_path, monkeypatch):
    import wandb  # noqa: F401  (in the test extra: the real package, offline)

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    clock = FakeClock()
    processor = MetricsProcessor.Config(enable_wandb=True, cpu_peak_tflops=10.0).build(
        dump_folder=str(tmp_path), device="cpu", num_flops_per_token=6e9, rank=0, clock=clock)
    sent: dict[str, dict[int, float]] = {}
    real_log = processor.wandb_run.log

    def recording_log(values, step):
        for tag, value in values.items():
            sent.setdefault(tag, {})[step] = value
        real_log(values, step=step)

    processor.wandb_run.log = recording_log
    for step, loss in ((1, 4.0), (10, 3.0)):
        processor.record_tokens(2000)
        clock.now += 4.0
        processor.log(step, loss=loss, grad_norm=0.5, lr=1e-3)
    processor.log_validation(10, 3.5)
    processor.close()

    events = EventAccumulator(os.path.join(str(tmp_path), "tb"))
    events.Reload()
    board = {tag: {e.step: e.value for e in events.Scalars(tag)} for tag in events.Tags()["scalars"]}
    assert sent.keys() == board.keys()
    for tag in board:  # TensorBoard keeps float32, W&B the Python float
        assert board[tag] == pytest.approx(sent[tag], rel=1e-6), tag
    runs = [name for name in os.listdir(tmp_path / "wandb" / "wandb") if name.startswith("offline-run-")]
    assert len(runs) == 1 and any(f.endswith(".wandb") for f in os.listdir(tmp_path / "wandb" / "wandb" / runs[0]))


def test_enabling_wandb_without_the_package_names_the_fix(monkeypatch):
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real_find_spec(name, *a))
    with pytest.raises(ValueError, match=r"metrics.enable_wandb=True needs the wandb package, which is not installed: "
                                         r"pip install -e \.\[wandb\]"):
        MetricsProcessor.Config(enable_wandb=True)
    assert MetricsProcessor.Config().enable_wandb is False and MetricsProcessor.Config().enable_tensorboard is True
