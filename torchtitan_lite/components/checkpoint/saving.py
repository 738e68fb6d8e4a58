"""Writing one checkpoint: the state it holds, a clean folder for it, the marker that completes it, the
verdict on a save that failed, the one save that may still be writing in the background, and the
Hugging Face export of the last one.

Rank 0 writes the marker only once DCP's final gather says every rank has finished writing. A save that
fails (disk full, quota, read-only) is described in words on every rank, its partial folder is removed,
and the run stops or warns (``on_save_error``).
"""
from __future__ import annotations

import logging
import os
import shutil
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.stateful import Stateful

from torchtitan_lite.components.checkpoint import hf_io
from torchtitan_lite.components.checkpoint.checksums import ALGORITHM, ChecksummingWriter, hash_file
from torchtitan_lite.components.checkpoint.disk import describe_save_error
from torchtitan_lite.components.checkpoint.followups import Followups
from torchtitan_lite.components.checkpoint.layout import (
    MARKER_NAME,
    Marker,
    hf_export_dir,
    scan_steps,
    step_dir,
    write_text_atomically,
)
from torchtitan_lite.components.checkpoint.run_config import RUN_CONFIG_NAME
from torchtitan_lite.components.checkpoint.stateful import PER_RANK_STATES, encode
from torchtitan_lite.components.checkpoint.verify import CheckpointError, describe_failure, read_metadata

# Under the checkpoint manager's name: the checkpoint lines of a run carry one name, whichever module writes them.
logger = logging.getLogger("torchtitan_lite.components.checkpoint.manager")

EXPORT_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def state_to_save(states: dict[str, Stateful], model_only: bool, *, export_dtype: str, rank: int) -> dict[str, Any]:
    """What a checkpoint of ``states`` holds: only the model in ``export_dtype`` when ``model_only``."""
    if model_only:
        dtype = EXPORT_DTYPES[export_dtype]
        model = states["model"].state_dict()
        return {"model": {k: v.to(dtype) if v.is_floating_point() else v for k, v in model.items()}}
    state = {}
    for name, obj in states.items():
        if name in PER_RANK_STATES:
            state[name] = {f"rank{rank}": encode(obj.state_dict())}
        else:
            state[name] = obj.state_dict()
    return state


def prepare_folder(path: str, rank: int) -> None:
    """``path`` does not exist when any rank starts writing into it (collective)."""
    if rank == 0 and os.path.exists(path):
        # Re-saving a step (a resumed run that went back): the old folder must not keep its
        # marker while being overwritten, and stale shard files must not linger.
        logger.warning("overwriting existing checkpoint folder %s", path)
        marker = os.path.join(path, MARKER_NAME)
        if os.path.exists(marker):
            os.remove(marker)
        shutil.rmtree(path)
    if dist.is_initialized():
        dist.barrier()


def mark_complete(path: str, marker: Marker, writer: ChecksummingWriter, *, run_config: str | None,
                  followups: Followups) -> None:
    """Rank 0, once every rank has written: the run's config, then the marker with the checksums of all files."""
    checksums = dict(writer.checksums or {})
    if run_config is not None:
        # Before the marker: a checkpoint is complete with the config that describes it, or not at all.
        write_text_atomically(os.path.join(path, RUN_CONFIG_NAME), run_config)
        checksums[RUN_CONFIG_NAME] = hash_file(os.path.join(path, RUN_CONFIG_NAME))
    marker.checksum_algorithm, marker.checksums = ALGORITHM, checksums
    # A normal loss may have followed this state while it was written.
    followups.write_marker(path, marker)


def conclude_save(folder: str, path: str, error: BaseException | None, *, rank: int, world_size: int,
                  on_save_error: str) -> bool:
    """Collective: whether the save of ``path`` succeeded on every rank. On a failure anywhere, rank 0
    removes the partial folder and every rank stops (raises) or warns, per ``on_save_error``."""
    reason = None if error is None else describe_save_error(folder, error, describe_failure(error))
    reasons = [reason]
    if dist.is_initialized() and world_size > 1:
        reasons = [None] * world_size
        dist.all_gather_object(reasons, reason)
    failed = [r for r in reasons if r is not None]
    if not failed:
        return True
    if rank == 0:
        marker = os.path.join(path, MARKER_NAME)
        if os.path.exists(marker):
            os.remove(marker)
        shutil.rmtree(path, ignore_errors=True)
    if dist.is_initialized() and world_size > 1:
        dist.barrier()  # every rank then describes the folder without the partial save
    complete = scan_steps(folder)[0]
    kept = (f"the previous complete checkpoint {step_dir(folder, complete[-1])} is kept" if complete
            else f"there is no complete checkpoint in {folder}")
    message = f"saving checkpoint {path} failed: {failed[0]}. The partial folder was removed; {kept}"
    if on_save_error == "stop":
        resume = (f"the run resumes from step {complete[-1]}" if complete
                  else "the run starts again from step 0, nothing was saved")
        raise CheckpointError(f"{message}. Free space or fix the folder, then rerun: {resume} "
                              f"(checkpoint.on_save_error=warn trains on without checkpoints instead)") from error
    logger.warning("%s; training continues (checkpoint.on_save_error=warn)", message)
    return False


class BackgroundSave:
    """The save writing in the background (at most one at a time), and the process groups it talks over."""

    def __init__(self, *, enabled: bool, world_size: int) -> None:
        self.world_size = world_size
        # Background saves talk over their own gloo group so they never interleave with the
        # training loop's collectives on the default group.
        self.save_group = None
        self.poll_group = None
        if enabled and dist.is_initialized():
            self.save_group = dist.new_group(backend="gloo")
            # Each step's "has every rank's background save finished?" goes over a third group: the save
            # group is busy inside the save, and the default group may be NCCL (a device sync each step).
            self.poll_group = dist.new_group(backend="gloo")
        self.pending: Future | None = None
        self.pending_path: str | None = None

    def start(self, upload: Future, path: str, marker: Marker, mark_complete: Callable[[], None]) -> None:
        """``upload`` (DCP's future) writes ``path``; ``mark_complete`` runs once it has finished."""
        done: Future = Future()

        def finish(f: Future) -> None:
            try:
                f.result()
                mark_complete()
                done.set_result(marker.step)
            except BaseException as e:  # noqa: BLE001 - handed to the waiting thread
                done.set_exception(e)

        upload.add_done_callback(finish)
        self.pending, self.pending_path = done, path

    def finished_on_every_rank(self) -> bool:
        """Whether a save is pending and has finished on every rank (collective, called at every step, does
        not block)."""
        if self.pending is None:
            return False
        done = self.pending.done()
        if self.poll_group is not None and self.world_size > 1:
            finished = torch.tensor([int(done)])
            dist.all_reduce(finished, op=dist.ReduceOp.MIN, group=self.poll_group)
            done = bool(finished.item())
        return done

    def outcome(self) -> tuple[str, BaseException | None] | None:
        """Block until the pending save has finished: its path and its error (None when it succeeded); None
        when no save is pending."""
        if self.pending is None:
            return None
        pending, self.pending = self.pending, None
        error: BaseException | None = None
        try:
            pending.result()
        except (Exception, CheckpointException) as e:
            error = e
        assert self.pending_path is not None
        return self.pending_path, error

    def close(self) -> None:
        for group in (self.save_group, self.poll_group):
            if group is not None:
                dist.destroy_process_group(group)
        self.save_group = self.poll_group = None


def export_hf(state: dict[str, Any], folder: str, step: int, adapter: Any, *, written: bool, export_dtype: str,
              run_config: str | None, rank: int) -> None:
    """Write the model of the checkpoint of ``step`` as Hugging Face files to ``<folder>/step-<N>-hf/``:
    ``state`` (this rank's model state), or the checkpoint's model when it was ``written`` (complete) and
    holds keys ``state`` lacks."""

    def add_config(out: str) -> None:
        if run_config is not None:
            write_text_atomically(os.path.join(out, RUN_CONFIG_NAME), run_config)

    saved = read_metadata(step_dir(folder, step)) if written else None
    if saved is not None and not {f"model.{k}" for k in state} >= set(hf_io.model_keys(saved)):
        # Pipeline stages: no rank holds the whole model, the checkpoint just written does.
        state = hf_io.load_dcp_model(step_dir(folder, step), saved) if rank == 0 else {}
    hf_io.export_model_state(state, hf_export_dir(folder, step), adapter, EXPORT_DTYPES[export_dtype],
                             write=rank == 0, extra=add_config)
