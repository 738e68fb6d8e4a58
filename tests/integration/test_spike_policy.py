"""training.spike_policy on real (tiny) training runs, in process: a planted spike is skipped without
touching a parameter, a run without spikes is bitwise the run without the policy, too many spikes roll
back to the last good checkpoint and skip the named batches, and resumes stay exact.

Equalities are bitwise (tolerance 0): on one CPU process every operation repeats in the same order on
the same data, so anything the policy changed by mistake would show.
"""
from __future__ import annotations

import json
import logging
import shutil

import pytest
import torch
from _cli import read_scalars
from _spike_runs import build_trainer, params_of, plant, record_steps, reference_labels, same

from torchtitan_lite.spike_guard import SpikeError

POLICY = ["--training.spike_policy.enable", "true", "--training.spike_policy.min_history", "3"]


def test_a_planted_spike_is_skipped_without_touching_the_parameters(tmp_path, caplog):
    trainer = build_trainer(tmp_path, 10, *POLICY, "--training.spike_policy.max_rollbacks", "0")
    labels = reference_labels(trainer, 10)
    plant(trainer, [labels[5]])  # the batch of step 6
    records = record_steps(trainer, snapshot=(6, 7))
    with caplog.at_level(logging.WARNING):
        trainer.train()

    assert {r.step: r.action for r in records} == {**{s: "apply" for s in range(1, 11)}, 6: "skip"}
    six = records[5]
    assert six.loss > 1000
    assert same(six.params_before, six.params_after), "a skipped step changed a parameter"
    assert same(six.adam_before, six.adam_after), "a skipped step changed the AdamW moments or step count"
    assert not same(records[6].params_before, records[6].params_after)  # the next step trains again
    # The schedule follows the step number through the skip.
    peak = trainer.config.optimizer.lr
    assert [r.lr for r in records] == [peak * trainer.lr_schedulers.lr_factor(s) for s in range(1, 11)]
    assert "loss spike at step 6: loss" in caplog.text and "update skipped (1 of 5 in a row allowed)" in caplog.text
    tb = read_scalars(tmp_path / "tb")
    assert tb["spike/skipped_steps"][6] == 1 and tb["spike/skipped_steps"][10] == 1
    assert tb["spike/z_score"][5] < 6 < tb["spike/z_score"][6]
    assert tb["spike/rollbacks"][10] == 0


def test_without_a_spike_the_policy_changes_nothing(tmp_path):
    off = build_trainer(tmp_path / "off", 8)
    on = build_trainer(tmp_path / "on", 8, *POLICY, "--training.spike_policy.signals", "loss,grad_norm",
                       "--training.spike_policy.min_history", "2", "--training.spike_policy.max_rollbacks", "0")
    runs = []
    for trainer in (off, on):
        runs.append(record_steps(trainer))
        trainer.train()
    assert [r.action for r in runs[1]] == ["apply"] * 8  # armed from step 3, never fired
    assert [r.loss for r in runs[0]] == [r.loss for r in runs[1]]
    assert same(params_of(off), params_of(on))


def test_an_fp16_overflow_is_the_scalers_skip_not_a_spike(tmp_path):
    trainer = build_trainer(tmp_path, 6, *POLICY, "--training.spike_policy.max_rollbacks", "0",
                            "--precision.param_dtype", "float16")
    plant(trainer, [reference_labels(trainer, 4)[3]], factor=1e30)  # step 4's gradients overflow in fp16
    records = record_steps(trainer)
    trainer.train()
    assert [r.action for r in records] == ["apply", "apply", "apply", "overflow", "apply", "apply"]
    assert trainer.grad_scaler is not None and trainer.grad_scaler.skipped_steps == 1
    assert trainer.spike_guard is not None and trainer.spike_guard.skipped_total == 0
    assert len(trainer.spike_guard.history["loss"]) == 5  # the overflowed step's loss is no sample either


def test_past_the_skip_limits_without_rollbacks_the_run_stops_naming_the_step(tmp_path):
    trainer = build_trainer(tmp_path, 8, *POLICY, "--training.spike_policy.max_rollbacks", "0",
                            "--training.spike_policy.max_consecutive_skips", "0")
    plant(trainer, [reference_labels(trainer, 5)[4]])
    with pytest.raises(SpikeError, match=r"loss spike at step 5 goes on past the skip limits "
                                         r"training\.spike_policy\.max_rollbacks=0 \(skip only\); stopping "
                                         r"without saving\. Lower optimizer\.lr"):
        trainer.train()


def test_resume_after_a_skipped_step_is_exact(tmp_path):
    ckpt = ["--checkpoint.enable", "true", "--checkpoint.interval", "6"]
    a = build_trainer(tmp_path / "a", 12, *POLICY, *ckpt)
    plant(a, [reference_labels(a, 4)[3]])
    run_a = record_steps(a)
    a.train()
    assert run_a[3].action == "skip"
    shutil.copytree(tmp_path / "a" / "checkpoint" / "step-6", tmp_path / "b" / "checkpoint" / "step-6")
    b = build_trainer(tmp_path / "b", 12, *POLICY, *ckpt)
    run_b = record_steps(b)
    b.train()
    assert [r.step for r in run_b] == list(range(7, 13))
    assert [r.loss for r in run_b] == [r.loss for r in run_a[6:]]
    assert same(params_of(a), params_of(b))
    assert a.spike_guard is not None and b.spike_guard is not None
    assert b.spike_guard.state_dict() == a.spike_guard.state_dict()  # statistics, counts, good checkpoints
    assert b.spike_guard.skipped_total == 1


ROLLBACK = [*POLICY, "--training.spike_policy.max_consecutive_skips", "1", "--training.spike_policy.max_rollbacks",
            "1", "--training.spike_policy.rollback_skip_before", "1", "--training.spike_policy.rollback_skip_after",
            "1", "--checkpoint.enable", "true", "--checkpoint.interval", "2"]


def logged_values(tb_dir, tag: str, *, step: int) -> list[float]:
    """Every value written for ``tag`` at ``step``, in the order written (re-logged steps included)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tb_dir), size_guidance={"scalars": 0}, purge_orphaned_data=False)
    acc.Reload()
    return [e.value for e in acc.Scalars(tag) if e.step == step]


def test_too_many_spikes_roll_back_and_skip_the_batches_around_them(tmp_path):
    a = build_trainer(tmp_path / "a", 14, *ROLLBACK)
    labels = reference_labels(a, 18)
    plant(a, [labels[7], labels[8]])  # the batches of steps 8 and 9
    records = record_steps(a, snapshot=(6, 10))
    a.train()

    # Step 8 is skipped, step 9 is the second spike in a row: back to checkpoint 6 (7 trained normally,
    # so 6 is known good; 8 is newer than the first spike). The batches of steps 7-10 (one before the
    # first spike, one after the last) are dropped: the rerun's step 7 trains on step 11's batch.
    assert [(r.step, r.action) for r in records[:9]] == [(s, "apply") for s in range(1, 8)] + [(8, "skip"),
                                                                                              (9, "rollback")]
    rerun = records[9:]
    assert [r.step for r in rerun] == list(range(7, 15)) and {r.action for r in rerun} == {"apply"}
    assert all(torch.equal(r.labels, labels[r.step + 3]) for r in rerun)
    assert same(rerun[0].params_before, records[5].params_after), "not the weights of checkpoint 6"
    assert same(rerun[0].adam_before, records[5].adam_after)
    # The data loader ends where 14 steps plus the 4 skipped batches leave it.
    fresh = build_trainer(tmp_path / "ref", 14)
    it = iter(fresh.dataloader)
    for _ in range(18):
        next(it)
    ref, got = fresh.dataloader.state_dict(), a.dataloader.state_dict()
    assert ref == got and got["consumed"] == 18 * a.config.training.local_batch_size

    folder = tmp_path / "a" / "checkpoint"
    assert sorted(p.name for p in (folder / "rolled_back_1").iterdir()) == ["step-8"]  # the abandoned run's
    assert json.loads((folder / "spike_rollbacks.json").read_text()) == [
        {"rollback": 1, "to_step": 6, "spike_steps": [8, 9], "skip_data_of_steps": [7, 10]}]
    assert read_scalars(tmp_path / "a" / "tb")["spike/rollbacks"][14] == 1
    # The rollback logs the z-score of the spike that caused it at the spike's step, not the value the
    # detector restored from checkpoint 6 had. It is the first of the step's two values (the rerun logs
    # step 9 again), so the events are read without TensorBoard's purge of re-logged steps. float32 in
    # the event file: relative 1e-6.
    spike_z = records[8].z_score
    assert spike_z is not None and spike_z > 6
    assert logged_values(tmp_path / "a" / "tb", "spike/z_score", step=9)[0] == pytest.approx(spike_z, rel=1e-6)

    # A run stopped right after the rollback, before its next checkpoint, resumes from checkpoint 6 and
    # still skips the window (recorded in spike_rollbacks.json): the same steps as the uninterrupted run.
    b_folder = tmp_path / "b" / "checkpoint"
    shutil.copytree(folder / "step-6", b_folder / "step-6")
    shutil.copy(folder / "spike_rollbacks.json", b_folder)
    b = build_trainer(tmp_path / "b", 14, *ROLLBACK)
    plant(b, [labels[7], labels[8]])
    resumed = record_steps(b)
    b.train()
    assert [r.loss for r in resumed] == [r.loss for r in rerun]
    assert b.spike_guard is not None and b.spike_guard.rollbacks == 1
