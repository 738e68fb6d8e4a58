"""CheckpointManager on one process: exact resume, completeness marker, purge, async, errors."""
from __future__ import annotations

import json
import logging
import os
import random

import pytest
import torch
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

from torchtitan_lite.components.checkpoint import CheckpointError, CheckpointManager, ModelWrapper
from torchtitan_lite.components.checkpoint.layout import MARKER_NAME, Marker, scan_steps

DIM = 64


class Tiny(nn.Module):
    def __init__(self, hidden: int = 2 * DIM) -> None:
        super().__init__()
        self.w1 = nn.Linear(DIM, hidden, bias=False)
        self.w2 = nn.Linear(hidden, DIM, bias=False)

    def forward(self, x):
        return self.w2(torch.relu(self.w1(x)))


class Optim:
    def __init__(self, model: nn.Module) -> None:
        self.model, self.opt = model, torch.optim.AdamW(model.parameters(), lr=1e-2)

    def state_dict(self):
        return get_optimizer_state_dict(self.model, self.opt)

    def load_state_dict(self, state) -> None:
        set_optimizer_state_dict(self.model, self.opt, state)


class Loader:
    """Data position with non-tensor state of the kinds real loaders keep."""

    def __init__(self) -> None:
        self.pos, self.name = 0, "corpus"

    def state_dict(self):
        return {"pos": self.pos, "name": self.name, "shards": [1, 2, 3]}

    def load_state_dict(self, state) -> None:
        self.pos, self.name = state["pos"], state["name"]


class Steps:
    """Step plus both RNG streams the training loop draws from."""

    def __init__(self) -> None:
        self.step = 0

    def state_dict(self):
        return {"step": torch.tensor(self.step), "torch_rng": torch.get_rng_state(),
                "python_rng": torch.tensor(random.getstate()[1], dtype=torch.int64)}

    def load_state_dict(self, state) -> None:
        self.step = int(state["step"])
        torch.set_rng_state(state["torch_rng"])
        random.setstate((3, tuple(int(v) for v in state["python_rng"]), None))


class Run:
    def __init__(self, dump: str, seed: int = 0, model: nn.Module | None = None, **cfg) -> None:
        torch.manual_seed(seed)
        self.model = model or Tiny()
        self.optim = Optim(self.model)
        self.sched = torch.optim.lr_scheduler.StepLR(self.optim.opt, step_size=2, gamma=0.5)
        self.loader, self.steps = Loader(), Steps()
        states = {"model": ModelWrapper(self.model), "optimizer": self.optim, "lr_scheduler": self.sched,
                  "dataloader": self.loader, "train_state": self.steps}
        cfg = {"enable": True, "interval": 2, **cfg}
        self.ckpt = CheckpointManager.Config(**cfg).build(dump_folder=dump, states=states)

    def train_step(self) -> float:
        self.steps.step += 1
        self.loader.pos += 1
        x = torch.randn(4, DIM) * (1 + random.random())
        loss = self.model(x).pow(2).mean()
        loss.backward()
        self.optim.opt.step()
        self.optim.opt.zero_grad()
        self.sched.step()
        return loss.item()

    def train(self, until: int) -> list[float]:
        losses = []
        while self.steps.step < until:
            losses.append(self.train_step())
            self.ckpt.save(self.steps.step, last_step=self.steps.step == until)
        return losses


class Evil:
    """Any class outside torch's weights-only allow-list."""


def ckpt_dir(dump, step):
    return os.path.join(dump, "checkpoint", f"step-{step}")


# --------------------------------------------------------------------------------------------------
# Config


@pytest.mark.parametrize("kwargs, text", [
    ({"interval": 0}, "checkpoint.interval=0"),
    ({"keep_latest_k": -1}, "checkpoint.keep_latest_k=-1"),
    ({"load_step": -2}, "checkpoint.load_step=-2"),
    ({"create_seed_checkpoint": True}, "needs checkpoint.enable=True"),
    ({"initial_load_path": ""}, "checkpoint.initial_load_path=''"),
])
def test_config_rejects_bad_values(kwargs, text):
    with pytest.raises(ValueError, match=text.replace("(", r"\(").replace(".", r"\.")):
        CheckpointManager.Config(**kwargs)


def test_exclude_from_loading_must_name_a_state(tmp_path):
    with pytest.raises(ValueError, match=r"unknown state\(s\) \['optimiser'\]"):
        Run(str(tmp_path), exclude_from_loading=["optimiser"])


def test_disabled_manager_neither_saves_nor_loads(tmp_path):
    run = Run(str(tmp_path), enable=False)
    assert run.ckpt.load() == 0
    assert run.ckpt.save(2, last_step=True) is False
    assert not os.path.exists(tmp_path / "checkpoint")


# --------------------------------------------------------------------------------------------------
# Exact resume


def test_resume_reproduces_losses_bitwise(tmp_path):
    # Run A trains 6 steps saving at 2, 4, 6; run B (different init) resumes at 4 and must produce
    # A's losses for steps 5-6 exactly: model, Adam moments, LR schedule, RNGs and data position all
    # restored; any drift shows up as a non-identical float.
    a = Run(str(tmp_path / "a"))
    losses_a = a.train(6)
    a.ckpt.close()

    os.makedirs(tmp_path / "b")
    os.symlink(tmp_path / "a" / "checkpoint", tmp_path / "b" / "checkpoint")
    b = Run(str(tmp_path / "b"), seed=123, load_step=4)
    assert b.ckpt.load() == 4
    assert (b.steps.step, b.loader.pos) == (4, 4)
    assert b.sched.last_epoch == 4 and b.optim.opt.param_groups[0]["lr"] == pytest.approx(1e-2 / 4)
    losses_b = []
    while b.steps.step < 6:
        losses_b.append(b.train_step())
    assert losses_b == losses_a[4:]
    for p, q in zip(a.model.parameters(), b.model.parameters()):
        assert torch.equal(p, q)


def test_resume_picks_latest_complete_and_marker_records_the_save(tmp_path):
    a = Run(str(tmp_path))
    a.train(5)  # saves at 2, 4 and the last step 5
    a.ckpt.close()
    marker = json.loads((tmp_path / "checkpoint" / "step-5" / MARKER_NAME).read_text())
    assert marker["step"] == 5 and marker["world_size"] == 1 and marker["model_only"] is False
    assert marker["states"] == ["dataloader", "lr_scheduler", "model", "optimizer", "train_state"]
    b = Run(str(tmp_path), seed=1)
    assert b.ckpt.load() == 5 and b.steps.step == 5


def test_interval_and_forced_saves(tmp_path):
    run = Run(str(tmp_path), interval=3)
    assert [run.ckpt.save(s) for s in (1, 2, 3)] == [False, False, True]
    assert run.ckpt.save(3, force=True) is False  # the same step is not written twice
    assert run.ckpt.save(4, force=True) and run.ckpt.save(5, last_step=True)
    assert scan_steps(str(tmp_path / "checkpoint")) == ([3, 4, 5], [])


def test_exclude_from_loading_keeps_fresh_state(tmp_path):
    a = Run(str(tmp_path))
    a.train(2)
    b = Run(str(tmp_path), seed=5, exclude_from_loading=["model", "dataloader"])
    fresh = [p.clone() for p in b.model.parameters()]
    assert b.ckpt.load() == 2
    assert b.loader.pos == 0 and b.steps.step == 2
    assert all(torch.equal(p, q) for p, q in zip(fresh, b.model.parameters()))


# --------------------------------------------------------------------------------------------------
# Completeness marker and purge


def test_folder_without_marker_is_ignored(tmp_path, caplog):
    a = Run(str(tmp_path))
    a.train(4)
    expected = [p.clone() for p in a.model.parameters()]
    a.train(6)
    # A crash mid-save of step 6 (marker never written) and a stray half-written step-8 folder.
    os.remove(os.path.join(ckpt_dir(tmp_path, 6), MARKER_NAME))
    os.makedirs(ckpt_dir(tmp_path, 8))
    (tmp_path / "checkpoint" / "step-8" / "__0_0.distcp").write_bytes(b"partial")
    b = Run(str(tmp_path), seed=3)
    with caplog.at_level(logging.WARNING):
        assert b.ckpt.load() == 4
    assert "step-6" in caplog.text and "step-8" in caplog.text
    assert all(torch.equal(p, q) for p, q in zip(expected, b.model.parameters()))
    assert b.ckpt.last_complete_step() == 4


def test_keep_latest_k_purges_older_complete_checkpoints(tmp_path):
    run = Run(str(tmp_path), interval=1, keep_latest_k=2)
    run.train(3)
    os.makedirs(ckpt_dir(tmp_path, 2) + "x")  # unrelated folder names are never touched
    run.train(5)
    assert scan_steps(str(tmp_path / "checkpoint")) == ([4, 5], [])
    assert os.path.isdir(ckpt_dir(tmp_path, 2) + "x")


def test_purge_never_deletes_the_checkpoint_the_run_resumed_from(tmp_path):
    a = Run(str(tmp_path), interval=1)
    a.train(4)
    b = Run(str(tmp_path), interval=1, keep_latest_k=1, load_step=2)
    assert b.ckpt.load() == 2
    b.train(3)  # the step just written survives even though step-4 of the earlier run is newer
    assert scan_steps(str(tmp_path / "checkpoint")) == ([2, 3, 4], [])
    b.train(4)  # purges all but the newest and the loaded one
    assert scan_steps(str(tmp_path / "checkpoint")) == ([2, 4], [])


def test_resaving_a_step_replaces_the_folder(tmp_path):
    a = Run(str(tmp_path))
    a.train(2)
    stale = tmp_path / "checkpoint" / "step-2" / "__7_0.distcp"
    stale.write_bytes(b"from another layout")
    b = Run(str(tmp_path), seed=9, load_step=2)
    b.ckpt.load()
    b.ckpt.save(2, force=True)
    b.ckpt._last_saved_step = None
    assert not stale.exists() and Marker.read(ckpt_dir(tmp_path, 2)).step == 2


# --------------------------------------------------------------------------------------------------
# Async, model-only, seed and initial load


def test_async_save_writes_the_state_of_its_step(tmp_path):
    run = Run(str(tmp_path), async_mode="async")
    run.train(2)
    at_save = [p.clone() for p in run.model.parameters()]
    run.train_step()  # mutates parameters while the background write may still run
    run.ckpt.close()
    assert Marker.read(ckpt_dir(tmp_path, 2)).step == 2
    b = Run(str(tmp_path), seed=4)
    assert b.ckpt.load() == 2
    assert all(torch.equal(p, q) for p, q in zip(at_save, b.model.parameters()))


def test_async_failure_is_reported_and_keeps_previous(tmp_path, monkeypatch):
    from concurrent.futures import Future

    import torch.distributed.checkpoint as dcp

    run = Run(str(tmp_path), async_mode="async")
    run.train(2)
    run.ckpt.wait()

    def failing_async_save(state, **kwargs):
        failed = Future()
        failed.set_exception(OSError("disk full"))
        return failed

    monkeypatch.setattr(dcp, "async_save", failing_async_save)
    run.train(3)
    run.train_step()
    # Reported at the first step after it failed, not at the next save.
    with pytest.raises(CheckpointError, match=r"saving checkpoint .*step-3 failed: OSError: disk full\. The partial "
                                              r"folder was removed; the previous complete checkpoint .*step-2 is kept"):
        run.ckpt.save(run.steps.step)
    assert scan_steps(str(tmp_path / "checkpoint"))[0] == [2]


def test_last_save_model_only_in_export_dtype(tmp_path):
    from torch.distributed.checkpoint import FileSystemReader

    run = Run(str(tmp_path), last_save_model_only=True, export_dtype="bfloat16")
    run.train(3)
    meta = FileSystemReader(ckpt_dir(tmp_path, 3)).read_metadata().state_dict_metadata
    assert sorted(meta) == ["model.w1.weight", "model.w2.weight"]
    assert meta["model.w1.weight"].properties.dtype == torch.bfloat16
    assert Marker.read(ckpt_dir(tmp_path, 3)).model_only is True
    # Resuming from a model-only checkpoint restores the weights (bf16-rounded), the rest is fresh.
    b = Run(str(tmp_path), seed=8)
    assert b.ckpt.load() == 3
    assert torch.equal(b.model.w1.weight, run.model.w1.weight.bfloat16().float())
    assert b.loader.pos == 0


def test_seed_checkpoint_initialises_another_run(tmp_path, caplog):
    seed_run = Run(str(tmp_path / "seed"), seed=11, create_seed_checkpoint=True)
    assert seed_run.ckpt.load() == 0
    seed_run.ckpt.save(0, force=True, model_only=True)
    seed_run.ckpt.close()
    seed_path = ckpt_dir(tmp_path / "seed", 0)
    run = Run(str(tmp_path / "run"), seed=12, initial_load_path=seed_path)
    assert run.ckpt.load() == 0
    assert all(torch.equal(p, q) for p, q in zip(seed_run.model.parameters(), run.model.parameters()))
    # Once the run has its own checkpoint, initial_load_path is no longer consulted, and the run says so.
    run.train(2)
    again = Run(str(tmp_path / "run"), seed=13, initial_load_path=seed_path)
    assert again.ckpt.load() == 2 and torch.equal(again.model.w1.weight, run.model.w1.weight)
    assert (f"checkpoint.initial_load_path={seed_path} is not read: {tmp_path / 'run'}/checkpoint holds the checkpoint "
            f"of step 2, which this run resumes") in caplog.text


def test_initial_load_path_is_read_with_checkpointing_off(tmp_path):
    seed_run = Run(str(tmp_path / "seed"), seed=11, create_seed_checkpoint=True)
    seed_run.ckpt.save(0, force=True, model_only=True)
    seed_run.ckpt.close()
    run = Run(str(tmp_path / "run"), seed=12, enable=False, initial_load_path=ckpt_dir(tmp_path / "seed", 0))
    assert run.ckpt.load() == 0
    assert all(torch.equal(p, q) for p, q in zip(seed_run.model.parameters(), run.model.parameters()))
    assert not (tmp_path / "run" / "checkpoint").exists()


def test_initial_load_with_full_state_returns_its_step(tmp_path):
    a = Run(str(tmp_path / "a"))
    a.train(4)
    b = Run(str(tmp_path / "b"), seed=2, initial_load_path=ckpt_dir(tmp_path / "a", 4),
            initial_load_model_only=False)
    assert b.ckpt.load() == 4 and b.loader.pos == 4


# --------------------------------------------------------------------------------------------------
# Corrupt and mismatched input


def _saved(tmp_path, **cfg) -> str:
    run = Run(str(tmp_path), **cfg)
    run.train(2)
    return ckpt_dir(tmp_path, 2)


def test_missing_shard_file_is_named(tmp_path):
    path = _saved(tmp_path)
    os.remove(os.path.join(path, "__0_0.distcp"))
    with pytest.raises(CheckpointError, match=r"__0_0\.distcp is missing"):
        Run(str(tmp_path), seed=1).ckpt.load()
    assert os.path.isdir(path) and os.path.exists(os.path.join(path, MARKER_NAME))  # nothing deleted


def test_truncated_shard_file_is_named(tmp_path):
    path = _saved(tmp_path)
    shard = os.path.join(path, "__0_0.distcp")
    size = os.path.getsize(shard)
    with open(shard, "r+b") as f:
        f.truncate(size // 2)
    with pytest.raises(CheckpointError, match=rf"__0_0\.distcp is truncated: {size // 2} bytes"):
        Run(str(tmp_path), seed=1).ckpt.load()


def test_truncated_metadata_is_named(tmp_path):
    path = _saved(tmp_path)
    meta = os.path.join(path, ".metadata")
    with open(meta, "r+b") as f:
        f.truncate(10)
    with pytest.raises(CheckpointError, match=r"step-2/\.metadata is unreadable or truncated"):
        Run(str(tmp_path), seed=1).ckpt.load()


def test_shape_mismatch_names_key_and_both_shapes(tmp_path):
    _saved(tmp_path)
    with pytest.raises(CheckpointError, match=r"shape mismatch for 'model\.w1\.weight': checkpoint has "
                                              r"\(128, 64\), this run expects \(96, 64\).* or start this run in a "
                                              r"folder of its own with --job\.dump_folder DIR"):
        Run(str(tmp_path), seed=1, model=Tiny(hidden=96)).ckpt.load()


def test_missing_and_unexpected_model_keys(tmp_path):
    class Bigger(Tiny):
        def __init__(self):
            super().__init__()
            self.w3 = nn.Linear(DIM, DIM, bias=False)

    class Smaller(nn.Module):
        def __init__(self):
            super().__init__()
            self.w1 = nn.Linear(DIM, 2 * DIM, bias=False)

    _saved(tmp_path)
    with pytest.raises(CheckpointError, match=r"lacks 4 key\(s\).*'model\.w3\.weight'"):
        Run(str(tmp_path), seed=1, model=Bigger()).ckpt.load()
    with pytest.raises(CheckpointError, match=r"holds 1 model key\(s\) that no part of the model of this run loads, "
                                              r"first \['model\.w2\.weight'\]"):
        Run(str(tmp_path), seed=1, model=Smaller(), exclude_from_loading=["optimizer"]).ckpt.load()


def test_load_step_that_does_not_exist_lists_available(tmp_path):
    _saved(tmp_path)
    os.makedirs(ckpt_dir(tmp_path, 9))
    with pytest.raises(CheckpointError, match=r"load_step=7: there is no complete .*step-7; complete steps "
                                              r"in .*: \[2\]; incomplete .*: \[9\]"):
        Run(str(tmp_path), seed=1, load_step=7).ckpt.load()


def test_initial_load_path_that_is_not_dcp(tmp_path):
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text("{}")
    with pytest.raises(CheckpointError, match=r"hf is not a DCP checkpoint folder: .*\.metadata does not "
                                              r"exist\. It looks like a Hugging Face folder"):
        Run(str(tmp_path / "run"), initial_load_path=str(hf)).ckpt.load()
    _saved(tmp_path / "other")
    with pytest.raises(CheckpointError, match=r"It holds step-<N> folders"):
        Run(str(tmp_path / "run"), initial_load_path=str(tmp_path / "other" / "checkpoint")).ckpt.load()


def test_initial_load_path_without_model_state(tmp_path):
    import torch.distributed.checkpoint as dcp

    foreign = str(tmp_path / "foreign")
    dcp.save(Tiny().state_dict(), checkpoint_id=foreign, no_dist=True)  # flat keys, no "model." prefix
    with pytest.raises(CheckpointError, match=r"foreign holds none of the states \['model'\] \(its top-level "
                                              r"names are \['w1', 'w2'\]\)"):
        Run(str(tmp_path / "run"), initial_load_path=foreign).ckpt.load()


def test_pickled_objects_in_checkpoints_are_refused(tmp_path):
    import torch.distributed.checkpoint as dcp

    path = _saved(tmp_path)
    # Overwrite the checkpoint with one whose scheduler state holds an arbitrary Python object.
    run = Run(str(tmp_path / "x"))
    scheduler_state = {**run.sched.state_dict(), "last_epoch": Evil()}
    state = {"model": ModelWrapper(run.model).state_dict(), "lr_scheduler": scheduler_state}
    dcp.save(state, checkpoint_id=path, no_dist=True)
    # The files no longer match the marker's checksums; skip that check to reach the unpickling guard.
    b = Run(str(tmp_path), seed=1, exclude_from_loading=["optimizer", "dataloader", "train_state"],
            verify_checksums=False)
    with pytest.raises(CheckpointError, match=r"loading checkpoint .*step-2 failed: rank 0: UnpicklingError: "
                                              r"Weights only load failed.*Unsupported global"):
        b.ckpt.load()
