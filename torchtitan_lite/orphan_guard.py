"""A worker whose launcher died stops instead of training on as an orphan.

torchrun starts every worker in a session of its own, so a ``kill -9`` of the launcher's process group
(a terminal's, a scheduler's) kills torchrun but not the workers, and torchrun killed that way cannot
stop them: they went on training with parent pid 1, writing checkpoints, holding the devices and the
run's lock. A daemon thread compares the parent pid with the launcher's once a second and ends the
process when it changed. It ends it at once, without saving: the launcher is gone, peers may be gone
with it, and a save needs all of them (a checkpoint it interrupts has no marker and is never loaded).

A thread rather than Linux's PR_SET_PDEATHSIG: that one fires when the *thread* that started the
worker exits, which is not what it means here, and it exists only on Linux.
"""
from __future__ import annotations

import os
import sys
import threading
import time

LAUNCHED_BY_TORCHRUN = "TORCHELASTIC_RUN_ID"
"""Set by torchrun in every worker's environment."""


def stop_when_launcher_dies(interval_s: float = 1.0) -> threading.Thread | None:
    """Under torchrun, start the watch (returns its thread); elsewhere, or when the parent is already
    init (pid 1: a launcher that is itself a container's first process, whose death ends the
    container anyway), do nothing."""
    launcher = os.getppid()
    if LAUNCHED_BY_TORCHRUN not in os.environ or launcher == 1:
        return None
    thread = threading.Thread(target=_watch, args=(launcher, interval_s), name="orphan-guard", daemon=True)
    thread.start()
    return thread


def _watch(launcher: int, interval_s: float) -> None:
    while os.getppid() == launcher:
        time.sleep(interval_s)
    rank = os.environ.get("RANK", "?")
    sys.stderr.write(f"error: rank {rank} (pid {os.getpid()}): its launcher (pid {launcher}) is gone; stopping "
                     f"now without saving, the newest complete checkpoint is where the next run resumes\n")
    sys.stderr.flush()
    os._exit(1)
