"""Checkpoint integrity on one process: checksums, fallback to the previous checkpoint, failed saves."""
from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
from test_checkpoint_manager import Run, ckpt_dir

from torchtitan_lite.components.checkpoint import CheckpointError
from torchtitan_lite.components.checkpoint.layout import MARKER_NAME, Marker, scan_steps
from torchtitan_lite.loss_health import LossHealth

ROOT = Path(__file__).resolve().parents[2]


def flip_byte(path: str, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0x40]))


def folder_digest(path: str) -> dict[str, str]:
    return {name: hashlib.sha256(Path(path, name).read_bytes()).hexdigest() for name in sorted(os.listdir(path))}


@pytest.mark.parametrize("async_mode", ["disabled", "async"])
def test_marker_records_a_checksum_per_file_and_tensor(tmp_path, async_mode):
    run = Run(str(tmp_path), async_mode=async_mode)
    run.train(2)
    run.ckpt.wait()
    marker = Marker.read(ckpt_dir(tmp_path, 2))
    assert marker.checksum_algorithm == "xxh3_128"
    files = sorted(n for n in os.listdir(ckpt_dir(tmp_path, 2)) if n != MARKER_NAME)
    assert sorted(marker.checksums) == files
    shard = marker.checksums["__0_0.distcp"]
    assert shard["size"] == os.path.getsize(os.path.join(ckpt_dir(tmp_path, 2), "__0_0.distcp"))
    labels = [item[0] for item in shard["items"]]
    assert "model.w1.weight" in labels and any(label.startswith("optimizer.state.") for label in labels)


@pytest.mark.parametrize("where", ["first", "middle", "last"])
def test_flipped_byte_anywhere_in_a_shard_is_named(tmp_path, where):
    run = Run(str(tmp_path))
    run.train(2)
    shard = os.path.join(ckpt_dir(tmp_path, 2), "__0_0.distcp")
    size = os.path.getsize(shard)
    flip_byte(shard, {"first": 0, "middle": size // 2, "last": size - 1}[where])
    with pytest.raises(CheckpointError, match=r"step 2: .*__0_0\.distcp does not match its xxh3_128 checksum"):
        Run(str(tmp_path), seed=1).ckpt.load()


def test_flipped_byte_in_an_optimizer_tensor_names_it(tmp_path):
    run = Run(str(tmp_path))
    run.train(2)
    path = ckpt_dir(tmp_path, 2)
    items = Marker.read(path).checksums["__0_0.distcp"]["items"]
    label, offset, length, _ = next(i for i in items if i[0].startswith("optimizer.state.") and i[2] > 1000)
    flip_byte(os.path.join(path, "__0_0.distcp"), offset + length // 2)
    with pytest.raises(CheckpointError, match=rf"bytes \[{offset}, {offset + length}\) of '{label}' changed"):
        Run(str(tmp_path), seed=1).ckpt.load()


@pytest.mark.parametrize("damage", ["flipped byte", "truncated shard", "missing .metadata"])
def test_auto_resume_falls_back_to_the_previous_complete_checkpoint(tmp_path, damage, caplog):
    run = Run(str(tmp_path))
    run.train(4)  # checkpoints at 2 and 4
    path = ckpt_dir(tmp_path, 4)
    shard = os.path.join(path, "__0_0.distcp")
    if damage == "flipped byte":
        flip_byte(shard, os.path.getsize(shard) // 3)
    elif damage == "truncated shard":
        os.truncate(shard, os.path.getsize(shard) - 7)
    else:
        os.remove(os.path.join(path, ".metadata"))
    b = Run(str(tmp_path), seed=1)
    with caplog.at_level(logging.WARNING):
        assert b.ckpt.load() == 2
    assert f"checkpoint {path} fails verification and is skipped" in caplog.text
    assert f"resuming from {ckpt_dir(tmp_path, 2)} instead of the newer" in caplog.text
    # Training goes on from step 2 and re-saves step 4 over the damaged folder.
    b.train(4)
    assert Run(str(tmp_path), seed=2).ckpt.load() == 4


def test_explicit_load_step_that_fails_verification_is_an_error(tmp_path):
    run = Run(str(tmp_path))
    run.train(4)
    flip_byte(os.path.join(ckpt_dir(tmp_path, 4), "__0_0.distcp"), 100)
    with pytest.raises(CheckpointError, match=r"checkpoint\.load_step=4: .*step-4 fails verification: .*__0_0\.distcp "
                                              r"does not match"):
        Run(str(tmp_path), seed=1, load_step=4).ckpt.load()


def test_verify_checksums_false_loads_without_hashing(tmp_path):
    run = Run(str(tmp_path))
    run.train(2)
    marker = Marker.read(ckpt_dir(tmp_path, 2))
    marker.checksums["__0_0.distcp"]["hash"] = "0" * 32  # a wrong record, as if the file had changed
    marker.write(ckpt_dir(tmp_path, 2))
    assert Run(str(tmp_path), seed=1, verify_checksums=False).ckpt.load() == 2
    with pytest.raises(CheckpointError, match="does not match"):
        Run(str(tmp_path), seed=1).ckpt.load()


def test_verify_checkpoint_script(tmp_path):
    run = Run(str(tmp_path))
    run.train(4)
    script = [sys.executable, str(ROOT / "scripts" / "verify_checkpoint.py")]
    ok = subprocess.run([*script, str(tmp_path / "checkpoint")], capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0, ok.stderr
    assert f"{ckpt_dir(tmp_path, 2)}: OK" in ok.stdout and f"{ckpt_dir(tmp_path, 4)}: OK" in ok.stdout
    flip_byte(os.path.join(ckpt_dir(tmp_path, 4), "__0_0.distcp"), 5)
    bad = subprocess.run([*script, str(tmp_path / "checkpoint")], capture_output=True, text=True, timeout=120)
    assert bad.returncode == 1
    assert f"{ckpt_dir(tmp_path, 4)}: FAILED" in bad.stdout and "__0_0.distcp does not match" in bad.stdout


# --------------------------------------------------------------------------------------------------
# Failed saves


def _tmpfs(path: Path, size: str) -> bool:
    """Mount a small tmpfs at ``path``; False where this process may not mount (not root, no CAP_SYS_ADMIN)."""
    path.mkdir()
    try:
        return subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                              capture_output=True, timeout=30).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


@pytest.fixture
def full_disk(tmp_path, monkeypatch):
    """A dump folder whose disk fills up during the second save: a real 1.5 MiB tmpfs when it can be
    mounted, else writes that fail with ENOSPC from the second save on. Yields (folder, kind)."""
    dump = tmp_path / "dump"
    if _tmpfs(dump, "1536k"):
        yield dump, "tmpfs"
        subprocess.run(["umount", str(dump)], check=False, timeout=30)
        return
    import torch.distributed.checkpoint.filesystem as fs

    real, calls = fs._write_item, {"n": 0}

    def write_item(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] > 30:  # the first save writes fewer items than this
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(*args, **kwargs)

    monkeypatch.setattr(fs, "_write_item", write_item)
    yield dump, "injected ENOSPC"


def _big_run(dump: Path, **cfg) -> Run:
    from test_checkpoint_manager import Tiny

    # About 0.6 MiB per checkpoint (weights + two Adam moments): the 1.5 MiB tmpfs holds two, not three.
    return Run(str(dump), model=Tiny(hidden=800), **cfg)


@pytest.mark.parametrize("async_mode", ["disabled", "async"])
def test_disk_full_stops_keeps_the_previous_checkpoint_and_resumes(full_disk, async_mode):
    dump, kind = full_disk
    print(f"disk-full test ran on: {kind}")
    run = _big_run(dump, async_mode=async_mode)
    run.train(2)
    run.ckpt.wait()
    before = folder_digest(ckpt_dir(dump, 2))
    with pytest.raises(CheckpointError, match=r"saving checkpoint .*step-(4|6) failed: the disk is full.*The partial "
                                              r"folder was removed; the previous complete checkpoint .*step-2 is kept"):
        run.train(6)
        run.ckpt.close()
    complete, incomplete = scan_steps(str(dump / "checkpoint"))
    assert incomplete == [] and complete[0] == 2
    assert folder_digest(ckpt_dir(dump, 2)) == before  # bit-identical
    # The next run resumes without any manual cleanup.
    assert _big_run(dump, seed=1).ckpt.load() == complete[-1]


def test_an_async_save_that_failed_stops_the_run_before_the_next_save(tmp_path, monkeypatch):
    import time

    import torch.distributed.checkpoint.filesystem as fs

    def write_item(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    run = Run(str(tmp_path), async_mode="async", interval=5)
    run.train(4)  # the last step is saved: step 4
    run.ckpt.wait()
    monkeypatch.setattr(fs, "_write_item", write_item)
    stopped_at = None
    with pytest.raises(CheckpointError, match=r"saving checkpoint .*step-5 failed: the disk is full .*the previous "
                                              r"complete checkpoint .*step-4 is kept"):
        for step in range(5, 10):
            stopped_at = step
            run.train_step()
            run.ckpt.save(step)
            time.sleep(0.5)  # the background write fails within far less than the 2 s before step 9
    assert stopped_at is not None and 5 < stopped_at < 10  # before step 10's save, where it was noticed before
    assert scan_steps(str(tmp_path / "checkpoint")) == ([4], [])  # the partial folder is gone at once


def test_disk_full_with_warn_trains_on(full_disk, caplog):
    dump, kind = full_disk
    print(f"disk-full test ran on: {kind}")
    run = _big_run(dump, on_save_error="warn")
    with caplog.at_level(logging.WARNING):
        run.train(8)
    assert "the disk is full" in caplog.text and "training continues (checkpoint.on_save_error=warn)" in caplog.text
    assert run.steps.step == 8
    complete, incomplete = scan_steps(str(dump / "checkpoint"))
    assert incomplete == [] and 2 in complete


def test_read_only_checkpoint_folder_is_found_before_training(tmp_path):
    if os.geteuid() == 0:
        # root writes through permission bits: a read-only bind is the honest test, if mountable.
        ro = tmp_path / "ro"
        ro.mkdir()
        (tmp_path / "src").mkdir()
        if subprocess.run(["mount", "--bind", "-o", "ro", str(tmp_path / "src"), str(ro)],
                          capture_output=True, timeout=30).returncode != 0:
            pytest.skip("root without mount permission: cannot make a read-only folder")
        dump = ro
    else:
        dump = tmp_path / "dump"
        (dump / "checkpoint").mkdir(parents=True)
        os.chmod(dump / "checkpoint", 0o500)
    try:
        with pytest.raises(CheckpointError, match=r"cannot write the checkpoint folder .*checkpoint: "):
            Run(str(dump)).ckpt.check_storage()
    finally:
        if os.geteuid() == 0:
            subprocess.run(["umount", str(dump)], check=False, timeout=30)


def test_too_little_space_for_one_checkpoint_is_found_before_training(tmp_path, monkeypatch):
    import shutil

    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(shutil, "disk_usage", lambda _: usage._replace(free=1000))
    with pytest.raises(CheckpointError, match=r"has 0\.00 GiB free, less than one checkpoint of this run"):
        Run(str(tmp_path)).ckpt.check_storage()
    Run(str(tmp_path), on_save_error="warn").ckpt.check_storage()  # a warning only


# --------------------------------------------------------------------------------------------------
# Which checkpoint is good


def test_a_checkpoint_is_good_only_once_the_next_step_trained_normally():
    health = LossHealth()
    # Step 1 trains at a normal loss; its update blows the weights up and step 2's loss shows it.
    assert health.observe(1, 7.0)
    assert not health.observe(2, 1.1e6)
    assert health.last_good([1]) is None  # checkpoint 1 holds the blown-up weights
    assert health.last_good([0, 1]) == 0
    assert not health.observe(3, float("nan"))


def test_spike_bounds_follow_the_running_statistics():
    import statistics

    losses = [3.0 + 0.01 * (i % 3) for i in range(20)]
    health = LossHealth(k_sigma=6.0, max_ratio=3.0, min_history=10)
    for step, loss in enumerate(losses, start=1):
        assert health.observe(step, loss)
    # 6 sample standard deviations (about 0.05) above the mean is far below the 3x ratio bound;
    # 1e-12 relative: the same formula in another order of summation.
    expected = statistics.mean(losses) + 6 * statistics.stdev(losses)
    assert health.bounds() == pytest.approx(expected, rel=1e-12)
    assert not health.is_normal(3.2)
    assert health.last_good(list(range(21))) == 19


def test_marker_json_of_older_checkpoints_still_loads(tmp_path):
    run = Run(str(tmp_path))
    run.train(2)
    marker_path = os.path.join(ckpt_dir(tmp_path, 2), MARKER_NAME)
    data = json.loads(Path(marker_path).read_text())
    del data["checksums"], data["checksum_algorithm"]
    Path(marker_path).write_text(json.dumps(data))
    assert Run(str(tmp_path), seed=1).ckpt.load() == 2


def test_marker_fields_of_a_later_release_are_ignored(tmp_path):
    run = Run(str(tmp_path))
    run.train(2)
    marker_path = os.path.join(ckpt_dir(tmp_path, 2), MARKER_NAME)
    data = json.loads(Path(marker_path).read_text())
    Path(marker_path).write_text(json.dumps({**data, "added_later": [1, 2]}))
    assert Marker.read(ckpt_dir(tmp_path, 2)).followed_by == data["followed_by"] == "nothing"
    assert Run(str(tmp_path), seed=1).ckpt.load() == 2


def test_the_storage_check_leaves_a_fresh_optimizer_untouched(tmp_path):
    # Asking DCP for an unstepped optimizer's state creates it with a zero-lr step (Adam's step count
    # then starts at 1 and every later update differs): the check must size it without asking.
    run = Run(str(tmp_path))
    run.ckpt.check_storage()
    assert run.optim.opt.state == {}
