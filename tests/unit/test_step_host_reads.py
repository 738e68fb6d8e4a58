"""A training step reads device values to the host only where something must act on them.

On a GPU every such read (``float(t)``, ``t.item()``, ``bool(t)``, ``t.tolist()``) waits for the device to
finish all queued work, so the CPU cannot queue the next step meanwhile. On a CPU the same reads are
counted: ``aten._local_scalar_dense`` (behind float / item / bool / int) through a dispatch mode, and
``Tensor.tolist`` (which on a CPU tensor bypasses the dispatcher) by wrapping it. Counts are exact
integers, per step of ``Trainer.train()``.
"""
from __future__ import annotations

import collections

import pytest
import torch
from _spike_runs import build_trainer, plant, reference_labels
from torch.utils._python_dispatch import TorchDispatchMode

from torchtitan_lite.trainer import NonFiniteLossError, Trainer

STEPS = 5
LOG_FREQ = 4
"""Steps 1, 4 (every log_freq) and 5 (the last) are log steps; 2 and 3 are not."""


class HostReads(TorchDispatchMode):
    def __init__(self, trainer: Trainer) -> None:
        super().__init__()
        self.trainer = trainer
        self.per_step: collections.Counter[int] = collections.Counter()

    def count(self) -> None:
        self.per_step[self.trainer.train_state.step] += 1

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            self.count()
        return func(*args, **(kwargs or {}))


def reads_per_step(trainer: Trainer, monkeypatch) -> dict[int, int]:
    reads = HostReads(trainer)
    tolist = torch.Tensor.tolist

    def counted_tolist(self):
        reads.count()
        return tolist(self)

    monkeypatch.setattr(torch.Tensor, "tolist", counted_tolist)
    with reads:
        trainer.train()
    return {step: n for step, n in reads.per_step.items() if step > 0}  # step 0: loading, before training


@pytest.mark.parametrize(("flags", "expected"), [
    # One read per log step (the loss and norm of every step since the previous one, in one transfer).
    (["--precision.param_dtype", "bfloat16"], {1: 1, 4: 1, 5: 1}),
    # The scaler reads its overflow flag every step (it decides whether the optimizer steps); log steps add one.
    (["--precision.param_dtype", "float16"], {1: 2, 2: 1, 3: 1, 4: 2, 5: 2}),
    # The spike policy reads loss and norm every step to judge it; log steps reuse those values.
    (["--precision.param_dtype", "bfloat16", "--training.spike_policy.enable", "true",
      "--training.spike_policy.max_rollbacks", "0"], {1: 1, 2: 1, 3: 1, 4: 1, 5: 1}),
], ids=["bf16", "fp16-scaler", "spike-policy"])
def test_host_reads_per_step(tmp_path, monkeypatch, flags, expected):
    trainer = build_trainer(tmp_path, STEPS, "--metrics.log_freq", str(LOG_FREQ), *flags)
    assert reads_per_step(trainer, monkeypatch) == expected


def test_moe_router_metrics_are_read_at_log_steps_only(tmp_path, monkeypatch):
    # The router counts stay on the device between log steps; each log step reads all of them in one more transfer.
    from tests.unit.test_qwen3_moe_training import _trainer

    trainer = _trainer(tmp_path, STEPS, "--metrics.log_freq", str(LOG_FREQ))
    assert reads_per_step(trainer, monkeypatch) == {1: 2, 4: 2, 5: 2}


def _diverging_at(trainer: Trainer, step: int) -> None:
    """The loss of every step from ``step`` on is NaN."""
    loss_fn = trainer.runner.loss_fn

    def diverging(logits, labels):
        loss_sum, count = loss_fn(logits, labels)
        return (loss_sum * float("nan") if trainer.train_state.step >= step else loss_sum), count

    trainer.runner.loss_fn = diverging


def test_a_non_finite_step_is_found_at_the_next_log_step_and_named(tmp_path, caplog):
    trainer = build_trainer(tmp_path, 10, "--metrics.log_freq", str(LOG_FREQ))
    _diverging_at(trainer, 2)
    with caplog.at_level("INFO", logger="torchtitan_lite"), pytest.raises(NonFiniteLossError) as error:
        trainer.train()
    assert "non-finite loss at step 2 (loss=nan" in str(error.value)
    assert trainer.train_state.step == LOG_FREQ  # read (and stopped) at the first log step after it
    # Step 1's normal loss vouched for checkpoint 0; nothing after the non-finite step joined the statistics.
    assert trainer.health.good_checkpoints == {0}
    assert len(trainer.health.recent) == 1
    logged = [r.getMessage() for r in caplog.records if "loss" in r.getMessage() and "step" in r.getMessage()]
    assert [m.split()[1] for m in logged if m.startswith("step ")] == ["1"]


def test_a_checkpoint_save_reads_first_and_saves_nothing_after_a_non_finite_step(tmp_path):
    trainer = build_trainer(tmp_path, 10, "--metrics.log_freq", "100", "--checkpoint.enable", "true",
                            "--checkpoint.interval", "3")
    _diverging_at(trainer, 2)
    with pytest.raises(NonFiniteLossError, match="non-finite loss at step 2 .*no checkpoint was saved"):
        trainer.train()
    assert trainer.train_state.step == 3  # the save of step 3 read the queued steps before writing
    assert not (tmp_path / "checkpoint" / "step-3").exists()


def test_queued_steps_feed_loss_health_as_step_by_step_reads_would(tmp_path):
    # A planted spike at step 3 (abnormal loss: no vouching, not in the statistics) among normal steps, all
    # read at once at step 4: LossHealth ends as it would with every step read as it ended.
    trainer = build_trainer(tmp_path, 4, "--metrics.log_freq", str(LOG_FREQ))
    plant(trainer, [reference_labels(trainer, 3)[2]], factor=1e4)
    trainer.train()
    assert trainer.health.good_checkpoints == {0, 1, 3}
    assert len(trainer.health.recent) == 3
