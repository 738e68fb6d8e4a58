"""The storage check before training on 2 gloo ranks that each hold one pipeline stage's layers: the
room needed is the whole checkpoint, both stages', not the share of the rank that checks."""
from __future__ import annotations

import shutil

import torch
import torch.nn as nn
from _ckpt_spawn import run_ranks
from test_checkpoint_reshard import Optim

from torchtitan_lite.components.checkpoint import CheckpointError, CheckpointManager, ModelWrapper

DIM = 64


class Stage(nn.Module):
    """Layer ``w<rank+1>`` of a 2-layer model, as a pipeline stage keeps its layers' names."""

    def __init__(self, rank: int) -> None:
        super().__init__()
        self.add_module(f"w{rank + 1}", nn.Linear(DIM, DIM, bias=False))


def check(rank: int, world_size: int, dump: str) -> str:
    torch.manual_seed(0)
    stage = Stage(rank)
    states = {"model": ModelWrapper(stage), "optimizer": Optim(stage)}
    ckpt = CheckpointManager.Config(enable=True).build(dump_folder=dump, states=states)
    # Room for one stage's weights and AdamW moments (3 x 4 bytes per parameter), not for both.
    one_stage = 3 * 4 * DIM * DIM
    usage = shutil.disk_usage(dump)
    shutil.disk_usage = lambda _: usage._replace(free=one_stage + 1)  # type: ignore[assignment]
    try:
        ckpt.check_storage()
    except CheckpointError as e:
        return str(e)
    return ""


def test_the_storage_check_counts_every_pipeline_stage(tmp_path):
    for message in run_ranks(check, 2, str(tmp_path)):
        assert "less than one checkpoint of this run" in message, message
