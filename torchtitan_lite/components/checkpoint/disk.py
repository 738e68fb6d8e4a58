"""The filesystem under the checkpoints: room and permission before training, causes of failed saves.

A full disk surfaces from inside torch.save as "enforce fail at inline_container.cc ... unexpected
pos" with no errno, so a failed save is explained by the errno when one is in the exception chain
and otherwise by looking at the filesystem itself (free space, writability) right after the failure.
"""
from __future__ import annotations

import contextlib
import errno
import logging
import os
import shutil
import uuid
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.stateful import Stateful

from torchtitan_lite.components.checkpoint.stateful import PER_RANK_STATES
from torchtitan_lite.components.checkpoint.verify import CheckpointError

# Under the checkpoint manager's name: the checkpoint lines of a run carry one name, whichever module writes them.
logger = logging.getLogger("torchtitan_lite.components.checkpoint.manager")

_NEARLY_FULL = 64 << 20
"""Free bytes under which a failed write without errno is put down to a full disk."""

_WORDS = {
    errno.ENOSPC: "the disk is full (ENOSPC, no space left on device)",
    errno.EDQUOT: "the disk quota is exhausted (EDQUOT)",
    errno.EROFS: "the filesystem is read-only (EROFS)",
    errno.EACCES: "permission denied (EACCES)",
    errno.EFBIG: "the file size limit was reached (EFBIG)",
}


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB"


def _chain(error: BaseException) -> Iterator[BaseException]:
    seen: set[int] = set()
    todo = [error]
    while todo:
        e = todo.pop()
        if id(e) in seen:
            continue
        seen.add(id(e))
        yield e
        if isinstance(e, CheckpointException):
            todo += [exc for exc, _ in e.failures.values() if isinstance(exc, BaseException)]
        todo += [c for c in (e.__cause__, e.__context__) if c is not None]


def describe_save_error(folder: str, error: BaseException, raw: str) -> str:
    """The cause of a failed save in words (disk full, quota, read-only ...), followed by ``raw``."""
    for e in _chain(error):
        if isinstance(e, OSError) and e.errno in _WORDS:
            return f"{_WORDS[e.errno]} writing under {folder} ({raw})"
    try:
        free = shutil.disk_usage(_existing_parent(folder)).free
    except OSError:
        return raw
    if free < _NEARLY_FULL:
        return f"the disk is full: the filesystem holding {folder} has {_gib(free)} free ({raw})"
    if not os.access(_existing_parent(folder), os.W_OK):
        return f"{folder} is not writable ({raw})"
    return raw


def _existing_parent(path: str) -> str:
    path = os.path.abspath(path)
    while not os.path.exists(path):
        path = os.path.dirname(path)
    return path


def state_sizes(states: dict[str, Stateful]) -> dict[str, int]:
    """Bytes of each tensor in ``states`` at its full (unsharded) size, by its checkpoint key
    (``<state>.<key>...``). Optimizers that create their moments at the first step count as empty."""
    sizes: dict[str, int] = {}

    def walk(key: str, value: Any) -> None:
        if isinstance(value, torch.Tensor):
            sizes[key] = value.numel() * value.element_size()  # a DTensor's numel is the global one
        elif isinstance(value, dict):
            for name, item in value.items():
                walk(f"{key}.{name}", item)
        elif isinstance(value, list | tuple):
            for i, item in enumerate(value):
                walk(f"{key}.{i}", item)

    for name, state in states.items():
        walk(name, state.state_dict())
    return sizes


ADAM_MOMENTS = 2
"""Optimizer tensors per parameter the storage check assumes (AdamW's exp_avg and exp_avg_sq)."""


def expected_checkpoint_sizes(states: dict[str, Stateful]) -> dict[str, int]:
    """Bytes each key of one checkpoint of ``states`` will hold from the start of training on, for the
    part of the model this rank holds (a pipeline stage holds only its own layers).

    The optimizer is sized from the model, not asked: reading its state_dict before its first step makes
    DCP create its states with a zero-lr step, which advances Adam's step count and changes the whole run.
    """
    sizes = state_sizes({n: s for n, s in states.items() if n != "optimizer"})
    if "optimizer" in states and "model" in states:
        for key, n in state_sizes({"model": states["model"]}).items():
            sizes[f"optimizer.{key}"] = ADAM_MOMENTS * n
    return sizes


def whole_checkpoint_bytes(per_rank: list[dict[str, int]]) -> int:
    """Bytes of the whole checkpoint from every rank's ``expected_checkpoint_sizes``: all ranks write into
    the same folder. A key several ranks hold (replicas, or shards of one tensor, which are sized whole)
    counts once; keys only some ranks hold (each pipeline stage's layers) all count."""
    whole: dict[str, int] = {}
    for sizes in per_rank:
        for key, n in sizes.items():
            whole[key] = max(whole.get(key, 0), n)
    return sum(whole.values())


def check_storage_before_training(folder: str, states: dict[str, Stateful], *, rank: int, world_size: int,
                                  on_save_error: str) -> None:
    """``folder`` is writable and has room for one checkpoint of ``states`` (rank 0 checks, every rank gets
    the verdict; collective)."""
    # Every rank writes its part into the same folder; under a pipeline each holds only its stage's layers.
    own = expected_checkpoint_sizes({n: s for n, s in states.items() if n not in PER_RANK_STATES})
    sizes: list[Any] = [own]
    if dist.is_initialized() and world_size > 1:
        sizes = [None] * world_size
        dist.all_gather_object(sizes, own)
    expected = whole_checkpoint_bytes(sizes)
    verdict = [check_writable_with_space(folder, expected) if rank == 0 else None]
    if dist.is_initialized() and world_size > 1:
        dist.broadcast_object_list(verdict, src=0)
    problem = verdict[0]
    if problem is None:
        return
    if on_save_error == "stop" or problem.startswith("cannot write"):
        raise CheckpointError(f"{problem} (checked before training, checkpoint.on_save_error=stop)")
    logger.warning("%s; training anyway (checkpoint.on_save_error=warn)", problem)


def check_writable_with_space(folder: str, expected_bytes: int) -> str | None:
    """None when ``folder`` can be created and written and its filesystem has ``expected_bytes`` free;
    otherwise the problem. 'cannot write' problems are always fatal, too little space may be a warning.
    A folder it had to create is removed again when it finds a problem: a refused run changes nothing."""
    created = not os.path.isdir(folder)
    problem = _writable_with_space(folder, expected_bytes)
    if problem is not None and created:
        with contextlib.suppress(OSError):
            os.rmdir(folder)
    return problem


def _writable_with_space(folder: str, expected_bytes: int) -> str | None:
    try:
        os.makedirs(folder, exist_ok=True)
        probe = os.path.join(folder, f".write-test-{uuid.uuid4().hex}")
        with open(probe, "wb") as f:
            f.write(b"0")
        os.remove(probe)
    except OSError as e:
        words = _WORDS.get(e.errno or 0, f"{type(e).__name__}: {e.strerror or e}")
        return f"cannot write the checkpoint folder {folder}: {words}; choose a writable job.dump_folder"
    free = shutil.disk_usage(folder).free
    if free < expected_bytes:
        return (f"the filesystem holding {folder} has {_gib(free)} free, less than one checkpoint of this run "
                f"(about {_gib(expected_bytes)}); free space or choose another job.dump_folder")
    return None
