"""Which checkpoint a run resumes from, and what it can say about the one it loaded.

Only folders with the completion marker count. The marker also holds a content hash of every file
(``checksums.py``). Before loading, the ranks split the files between them and verify them; an automatic
resume skips a latest checkpoint that fails (corrupt, truncated, ``.metadata`` missing) and takes the
previous one, an explicit ``load_step`` fails instead.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

from torchtitan_lite.components.checkpoint.layout import MARKER_NAME, describe_steps, step_dir
from torchtitan_lite.components.checkpoint.verify import CheckpointError, newest_verified_step, verify_together

# Under the checkpoint manager's name: the checkpoint lines of a run carry one name, whichever module writes them.
logger = logging.getLogger("torchtitan_lite.components.checkpoint.manager")


def initial_weights_passed_over(initial_load_path: str, folder: str, step: int) -> str:
    """Why checkpoint.initial_load_path is not read: the run's folder holds a checkpoint, which it resumes."""
    return (f"checkpoint.initial_load_path={initial_load_path} is not read: {folder} holds the checkpoint of step "
            f"{step}, which this run resumes (initial weights only start a folder without checkpoints); to start "
            f"from {initial_load_path}, use another --job.dump_folder")


@dataclass(frozen=True)
class LoadedCheckpoint:
    """The checkpoint a run resumed (or was initialised) from, as far as it can be vouched for."""

    path: str
    step: int
    unchecked: str | None
    """Why its files were not checked against checksums ('checkpoint.verify_checksums=false', 'it was
    written without checksums'), None when they were."""
    followed_by: str | None
    """``Marker.followed_by`` when it loaded: 'nothing', 'normal', 'abnormal', or None (not recorded)."""


def step_to_resume(folder: str, complete: list[int], incomplete: list[int], *, load_step: int, verify_checksums: bool,
                   rank: int, world_size: int) -> int | None:
    """The step of the complete checkpoint in ``folder`` a run resumes from (collective): ``load_step`` when it
    is set (>= 0), which must verify, else the newest that verifies; None when there is no complete one."""
    if incomplete:
        logger.warning("ignoring checkpoint folder(s) without a %s marker (interrupted saves): %s",
                       MARKER_NAME, [step_dir(folder, s) for s in incomplete])
    if load_step >= 0:
        if load_step not in complete:
            raise CheckpointError(f"checkpoint.load_step={load_step}: there is no complete "
                                  f"{step_dir(folder, load_step)}; {describe_steps(folder)}")
        problems = verify_together(step_dir(folder, load_step), checksums=verify_checksums, rank=rank,
                                   world_size=world_size)
        if problems:
            raise CheckpointError(f"checkpoint.load_step={load_step}: {step_dir(folder, load_step)} "
                                  f"fails verification: {'; '.join(problems)}. Load another step "
                                  f"({describe_steps(folder)}), or -1 for the newest one that verifies")
        return load_step
    if complete:
        return newest_verified_step(folder, complete, checksums=verify_checksums, rank=rank, world_size=world_size)
    return None
