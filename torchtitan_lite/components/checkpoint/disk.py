"""The filesystem under the checkpoints: room and permission before training, causes of failed saves.

A full disk surfaces from inside torch.save as "enforce fail at inline_container.cc ... unexpected
pos" with no errno, so a failed save is explained by the errno when one is in the exception chain
and otherwise by looking at the filesystem itself (free space, writability) right after the failure.
"""
from __future__ import annotations

import contextlib
import errno
import os
import shutil
import uuid
from collections.abc import Iterator
from typing import Any

import torch
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.stateful import Stateful

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


def state_bytes(states: dict[str, Stateful]) -> int:
    """Bytes of the tensors in ``states`` at their full (unsharded) sizes: what one checkpoint of them
    holds over all ranks. Optimizers that create their moments at the first step count as empty."""
    total = 0

    def walk(value: Any) -> None:
        nonlocal total
        if isinstance(value, torch.Tensor):
            total += value.numel() * value.element_size()  # a DTensor's numel is the global one
        elif isinstance(value, dict):
            for item in value.values():
                walk(item)
        elif isinstance(value, list | tuple):
            for item in value:
                walk(item)

    for state in states.values():
        walk(state.state_dict())
    return total


ADAM_MOMENTS = 2
"""Optimizer tensors per parameter the storage check assumes (AdamW's exp_avg and exp_avg_sq)."""


def expected_checkpoint_bytes(states: dict[str, Stateful]) -> int:
    """Bytes one checkpoint of ``states`` will hold, from the start of training on.

    The optimizer is sized from the model, not asked: reading its state_dict before its first step makes
    DCP create its states with a zero-lr step, which advances Adam's step count and changes the whole run.
    """
    others = {n: s for n, s in states.items() if n != "optimizer"}
    expected = state_bytes(others)
    if "optimizer" in states and "model" in states:
        expected += ADAM_MOMENTS * state_bytes({"model": states["model"]})
    return expected


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
