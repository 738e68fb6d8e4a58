"""One run per dump folder: the lock names its holder, stale locks are taken over."""
from __future__ import annotations

import json
import logging
import os
import socket
import subprocess
import sys

import pytest

from torchtitan_lite.run_lock import LOCK_NAME, RunLock, RunLockError


def test_second_acquire_is_refused_naming_the_holder(tmp_path):
    lock = RunLock.acquire(str(tmp_path))
    holder = json.loads((tmp_path / LOCK_NAME).read_text())
    assert holder["pid"] == os.getpid() and holder["host"] == socket.gethostname()
    with pytest.raises(RunLockError, match=rf"is in use by another run: pid {os.getpid()} on host "
                                           rf"{socket.gethostname()}, started "):
        RunLock.acquire(str(tmp_path))
    lock.release()
    assert not (tmp_path / LOCK_NAME).exists()
    RunLock.acquire(str(tmp_path)).release()  # free again


def test_lock_of_a_dead_process_is_taken_over_with_a_warning(tmp_path, caplog):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    pid = int(dead.stdout)
    (tmp_path / LOCK_NAME).write_text(json.dumps({"host": socket.gethostname(), "pid": pid, "pid_start": "1",
                                                  "start_time": "earlier", "command": "train.py"}))
    with caplog.at_level(logging.WARNING):
        lock = RunLock.acquire(str(tmp_path))
    assert f"taking over the stale lock {tmp_path / LOCK_NAME} of a run that is gone: pid {pid}" in caplog.text
    assert json.loads((tmp_path / LOCK_NAME).read_text())["pid"] == os.getpid()
    lock.release()


def test_reused_pid_counts_as_stale(tmp_path, caplog):
    # Our own pid with another start time: the recorded process ended and the pid was reused.
    (tmp_path / LOCK_NAME).write_text(json.dumps({"host": socket.gethostname(), "pid": os.getpid(),
                                                  "pid_start": "-1", "start_time": "x", "command": "y"}))
    with caplog.at_level(logging.WARNING):
        lock = RunLock.acquire(str(tmp_path))
    assert f"taking over the stale lock {tmp_path / LOCK_NAME} of a run that is gone: pid {os.getpid()}" in caplog.text
    holder = json.loads((tmp_path / LOCK_NAME).read_text())
    assert holder["pid"] == os.getpid() and holder["pid_start"] != "-1"  # our own start time now
    lock.release()
    assert not (tmp_path / LOCK_NAME).exists()


def test_lock_from_another_host_is_refused(tmp_path):
    (tmp_path / LOCK_NAME).write_text(json.dumps({"host": "elsewhere", "pid": 1, "pid_start": "1",
                                                  "start_time": "x", "command": "y"}))
    with pytest.raises(RunLockError, match=r"pid 1 on host elsewhere.*if it is gone, delete the lock file"):
        RunLock.acquire(str(tmp_path))


def test_dump_folder_that_is_a_file_is_named(tmp_path):
    (tmp_path / "f").write_text("x")
    with pytest.raises(RunLockError, match=r"cannot create job\.dump_folder=.*/f: File exists"):
        RunLock.acquire(str(tmp_path / "f"))
