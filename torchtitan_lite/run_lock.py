"""One training run per dump folder: ``<dump_folder>/.run.lock`` names the run that holds it.

Two runs on one folder resume each other's checkpoints and overwrite each other's later ones and
config.toml. The lock is a file created exclusively (O_CREAT | O_EXCL, which also works on NFS v3+)
holding the host, pid, the process's start time and the command. Only one process of a launch takes
it: global rank 0, which is LOCAL_RANK 0 on node 0, before any process-group work, so the ranks of
one run never refuse each other. A lock whose process is gone (same host, pid dead or reused by a
later process) is stale and taken over with a warning; a lock from another host cannot be checked
and is refused, naming the file to delete once that run is known to be gone.
"""
from __future__ import annotations

import json
import logging
import os
import socket
import sys
import time

logger = logging.getLogger(__name__)

LOCK_NAME = ".run.lock"


class RunLockError(ValueError):
    """The dump folder is held by another live run, or cannot hold a lock at all."""


def _process_start(pid: int) -> str | None:
    """Kernel start time of ``pid`` (clock ticks since boot), None when there is no such process."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return None
        except PermissionError:
            pass
        return "unknown"  # alive, start time not readable (no /proc)


class RunLock:
    def __init__(self, path: str) -> None:
        self.path = path

    @staticmethod
    def acquire(dump_folder: str) -> RunLock:
        path = os.path.join(dump_folder, LOCK_NAME)
        try:
            os.makedirs(dump_folder, exist_ok=True)
        except OSError as e:
            raise RunLockError(f"cannot create job.dump_folder={dump_folder}: {e.strerror or e}; choose a writable "
                               f"folder") from e
        me = {"host": socket.gethostname(), "pid": os.getpid(), "pid_start": _process_start(os.getpid()),
              "start_time": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "command": " ".join(sys.argv)}
        for _ in range(3):
            try:
                fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                holder = _read(path)
                if holder is None:
                    time.sleep(0.5)  # a run that has just created the file may not have written it yet
                    holder = _read(path)
                if holder is not None and not _is_stale(holder):
                    raise RunLockError(
                        f"job.dump_folder={dump_folder} is in use by another run: {describe(holder)} (lock file "
                        f"{path}). Use another job.dump_folder, or wait for that run to end; if it is gone, delete "
                        f"the lock file") from None
                logger.warning("taking over the stale lock %s of a run that is gone: %s", path,
                               describe(holder) if holder else "unreadable lock file")
                try:
                    os.remove(path)
                except FileNotFoundError:
                    pass
                continue
            except OSError as e:
                raise RunLockError(f"cannot write in job.dump_folder={dump_folder}: {e.strerror or e}; choose a "
                                   f"writable folder") from e
            with os.fdopen(fd, "w") as f:
                json.dump(me, f, indent=1)
            return RunLock(path)
        raise RunLockError(f"could not take the lock {path}: other processes keep creating it")

    def release(self) -> None:
        holder = _read(self.path)
        if holder is not None and holder.get("pid") == os.getpid() and holder.get("host") == socket.gethostname():
            os.remove(self.path)


def _read(path: str) -> dict | None:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def _is_stale(holder: dict) -> bool:
    if holder.get("host") != socket.gethostname():
        return False
    start = _process_start(int(holder.get("pid", -1)))
    return start is None or (start != "unknown" and start != holder.get("pid_start"))


def describe(holder: dict) -> str:
    return (f"pid {holder.get('pid')} on host {holder.get('host')}, started {holder.get('start_time')} "
            f"({holder.get('command')})")
