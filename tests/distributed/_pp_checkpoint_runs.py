"""Tiny llama3_debug runs under pipeline parallelism that save and resume checkpoints (test_pipeline_checkpoint.py)."""
from __future__ import annotations

from _spike_runs import build_trainer, record_steps

from torchtitan_lite.components.checkpoint.verify import CheckpointError

PP_BATCH = ["--training.local_batch_size", "4", "--parallelism.pipeline_microbatch_size", "1", "--model.n_layers", "4"]
"""4 micro-batches of 1 sample (enough for 1F1B on 4 stages and Interleaved1F1B's rounds of pp), 4 blocks (one
or more for each of 4 stages)."""
CHECKPOINTS = ["--checkpoint.enable", "true", "--checkpoint.interval", "1"]


def seed(rank: int, world_size: int, folder: str) -> None:
    """The 1-process seed checkpoint (model only, step 0) every compared run starts from."""
    build_trainer(folder, 1, *PP_BATCH, *CHECKPOINTS, "--checkpoint.create_seed_checkpoint", "true").train()


def train(rank: int, world_size: int, folder: str, steps: int, *extra: str) -> dict:
    """Train to ``steps`` (resuming from the folder's latest checkpoint); the loss, lr and labels of each step run."""
    trainer = build_trainer(folder, steps, *PP_BATCH, *CHECKPOINTS, *extra)
    records = record_steps(trainer)
    trainer.train()
    return {"losses": [r.loss for r in records], "steps": [r.step for r in records],
            "labels": [r.labels for r in records], "lr": [r.lr for r in records]}


def refused(rank: int, world_size: int, folder: str, steps: int, *extra: str) -> str:
    """This rank's refusal of the resume (every rank must refuse; none may wait for the others)."""
    trainer = build_trainer(folder, steps, *PP_BATCH, *CHECKPOINTS, *extra)
    try:
        trainer.train()
    except CheckpointError as e:
        return str(e)
    raise AssertionError("the resume was not refused")
