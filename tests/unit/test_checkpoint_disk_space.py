"""The room a checkpoint needs, counted over every rank, and what a failed first save says."""
from __future__ import annotations

import errno
import shutil

import pytest
import torch.nn as nn
from test_checkpoint_manager import Optim, Run, Tiny

from torchtitan_lite.components.checkpoint import CheckpointError, ModelWrapper
from torchtitan_lite.components.checkpoint.disk import (
    check_writable_with_space,
    expected_checkpoint_sizes,
    whole_checkpoint_bytes,
)


def _stage_sizes(full: Tiny, keep: str) -> dict[str, int]:
    """What one pipeline stage of ``full`` reports: only its own layer (the other one removed, as the
    pipeline split removes the layers of other stages), with an optimizer over it."""
    stage = Tiny()
    stage.load_state_dict(full.state_dict())
    for name in ("w1", "w2"):
        if name != keep:
            setattr(stage, name, nn.Identity())
    return expected_checkpoint_sizes({"model": ModelWrapper(stage), "optimizer": Optim(stage)})


def test_whole_checkpoint_adds_every_pipeline_stage_and_counts_replicas_once():
    full = Tiny()
    whole = expected_checkpoint_sizes({"model": ModelWrapper(full), "optimizer": Optim(full)})
    first, second = _stage_sizes(full, "w1"), _stage_sizes(full, "w2")
    assert 0 < sum(first.values()) < sum(whole.values())
    # Two stages, each held by two data-parallel ranks (their sizes are the whole tensors' sizes).
    assert whole_checkpoint_bytes([first, first, second, second]) == sum(whole.values())
    # Weights plus AdamW's two moments, 4-byte floats.
    assert sum(whole.values()) == 3 * 4 * sum(p.numel() for p in full.parameters())


def test_free_space_for_one_stage_but_not_the_whole_checkpoint_is_refused(tmp_path, monkeypatch):
    full = Tiny()
    stages = [_stage_sizes(full, "w1"), _stage_sizes(full, "w2")]
    free = sum(stages[0].values()) + 1  # enough for the first stage's share only
    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(shutil, "disk_usage", lambda _: usage._replace(free=free))
    folder = str(tmp_path / "checkpoint")
    assert check_writable_with_space(folder, sum(stages[0].values())) is None
    problem = check_writable_with_space(folder, whole_checkpoint_bytes(stages))
    assert problem is not None and "less than one checkpoint of this run" in problem


def _failing_writes(monkeypatch) -> None:
    import torch.distributed.checkpoint.filesystem as fs

    def write_item(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(fs, "_write_item", write_item)


@pytest.mark.parametrize("async_mode", ["disabled", "async"])
def test_a_failed_first_save_says_there_is_no_checkpoint_to_resume_from(tmp_path, monkeypatch, async_mode):
    _failing_writes(monkeypatch)
    run = Run(str(tmp_path), async_mode=async_mode)
    with pytest.raises(CheckpointError) as failed:
        run.train(2)
        run.ckpt.close()
    message = str(failed.value)
    assert f"there is no complete checkpoint in {tmp_path / 'checkpoint'}" in message
    assert "the run starts again from step 0, nothing was saved" in message
    assert "resumes" not in message


def test_a_failed_later_save_names_the_checkpoint_the_run_resumes_from(tmp_path, monkeypatch):
    run = Run(str(tmp_path))
    run.train(2)
    _failing_writes(monkeypatch)
    with pytest.raises(CheckpointError) as failed:
        run.train(4)
    message = str(failed.value)
    assert f"the previous complete checkpoint {tmp_path / 'checkpoint' / 'step-2'} is kept" in message
    assert "the run resumes from step 2" in message
