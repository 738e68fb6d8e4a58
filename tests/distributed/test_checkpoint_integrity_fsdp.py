"""Checkpoint integrity on FSDP 2 (gloo): a full disk during a save on one rank stops every rank,
leaves the previous checkpoint bit-identical and loadable; a corrupt shard of one rank makes every
rank fall back to the previous checkpoint."""
from __future__ import annotations

import errno
import hashlib
import os
import subprocess
from pathlib import Path

import pytest
import torch
import torch.nn as nn
from _ckpt_spawn import run_ranks
from test_checkpoint_reshard import Optim, Position

from torchtitan_lite.components.checkpoint import CheckpointError, CheckpointManager, ModelWrapper
from torchtitan_lite.components.checkpoint.layout import scan_steps

DIM, HIDDEN = 64, 800
"""About 1.2 MB per checkpoint (weights + two AdamW moments): a 1.5 MiB tmpfs holds one, not two."""


class Wide(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w1 = nn.Linear(DIM, HIDDEN, bias=False)
        self.w2 = nn.Linear(HIDDEN, DIM, bias=False)

    def forward(self, x):
        return self.w2(torch.relu(self.w1(x)))


def digest(path: str) -> dict[str, str]:
    return {n: hashlib.sha256(Path(path, n).read_bytes()).hexdigest() for n in sorted(os.listdir(path))}


def build(dump: str, rank: int, **cfg):
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = fully_shard(Wide())
    optim = Optim(model)
    states = {"model": ModelWrapper(model), "optimizer": optim, "train_state": Position(0)}
    return model, optim, states, CheckpointManager.Config(enable=True, interval=2, **cfg).build(dump_folder=dump,
                                                                                              states=states)


def train(model, optim, states, ckpt, steps) -> None:
    for step in steps:
        model(torch.randn(4, DIM)).pow(2).mean().backward()
        optim.opt.step()
        optim.opt.zero_grad()
        states["train_state"].value = step
        ckpt.save(step)


def disk_full(rank: int, world_size: int, dump: str, async_mode: str, inject: bool) -> tuple[str, bool, int]:
    model, optim, states, ckpt = build(dump, rank, async_mode=async_mode)
    train(model, optim, states, ckpt, [1, 2])
    ckpt.wait()
    before = digest(os.path.join(dump, "checkpoint", "step-2")) if rank == 0 else {}
    if inject and rank == 1:
        import torch.distributed.checkpoint.filesystem as fs

        def no_space(*args, **kwargs):
            raise OSError(errno.ENOSPC, "No space left on device")

        fs._write_item = no_space
    try:
        train(model, optim, states, ckpt, [3, 4])
        ckpt.close()
        message = ""
    except CheckpointError as e:
        message = str(e)
    same = rank != 0 or digest(os.path.join(dump, "checkpoint", "step-2")) == before
    _, _, states2, ckpt2 = build(dump, rank)
    return message, same, ckpt2.load()


def corrupt_fallback(rank: int, world_size: int, dump: str) -> int:
    import torch.distributed as dist

    model, optim, states, ckpt = build(dump, rank)
    train(model, optim, states, ckpt, [1, 2, 3, 4])
    ckpt.close()
    if rank == 0:  # one byte of rank 1's shard of step 4
        shard = os.path.join(dump, "checkpoint", "step-4", "__1_0.distcp")
        with open(shard, "r+b") as f:
            f.seek(os.path.getsize(shard) // 2)
            byte = f.read(1)
            f.seek(-1, 1)
            f.write(bytes([byte[0] ^ 1]))
    dist.barrier()
    _, _, states2, ckpt2 = build(dump, rank)
    step = ckpt2.load()
    assert states2["train_state"].value == step
    return step


def _mount_tmpfs(path: Path) -> bool:
    path.mkdir()
    try:
        return subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1536k", "tmpfs", str(path)],
                              capture_output=True, timeout=30).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


@pytest.mark.parametrize("async_mode", ["disabled", pytest.param("async", marks=pytest.mark.slow)])
def test_fsdp2_disk_full_stops_every_rank_and_keeps_the_previous_checkpoint(tmp_path, async_mode):
    dump = tmp_path / "dump"
    mounted = _mount_tmpfs(dump)
    print(f"FSDP 2 disk-full test ran on: {'tmpfs' if mounted else 'injected ENOSPC on rank 1'}")
    try:
        results = run_ranks(disk_full, 2, str(dump), async_mode, not mounted)
    finally:
        if mounted:
            subprocess.run(["umount", str(dump)], check=False, timeout=30)
    for message, same, resumed in results:
        assert "saving checkpoint" in message and "step-4 failed: the disk is full" in message, message
        assert "The partial folder was removed; the previous complete checkpoint" in message and "step-2 is kept" in message
        assert same and resumed == 2
    if not mounted:
        assert scan_steps(str(dump / "checkpoint")) == ([2], [])


def test_fsdp2_corrupt_shard_of_one_rank_falls_back_on_every_rank(tmp_path):
    assert run_ranks(corrupt_fallback, 2, str(tmp_path)) == [2, 2]
