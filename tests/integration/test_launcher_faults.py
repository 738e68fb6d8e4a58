"""scripts/torchrun_graceful.sh (run_train.sh's launcher) under faults, with small stand-in workers in
place of train.py (seconds, not a training run):
- ``kill -9`` of the launcher's process group: torchrun puts each worker in a session of its own, so the
  signal misses them; they must notice their launcher is gone and stop, not train on as orphans;
- a rank whose output ``LOG_RANK`` does not show fails first (an error, or an abort): its last lines are
  printed, since the one-line failure report points at them.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LAUNCHER = ROOT / "scripts" / "torchrun_graceful.sh"

SLEEPER = """
import os, sys, time
from torchtitan_lite.orphan_guard import stop_when_launcher_dies

stop_when_launcher_dies(interval_s=0.2)
with open(os.path.join(sys.argv[1], os.environ["RANK"] + ".pid"), "w") as f:
    f.write(str(os.getpid()))
time.sleep(120)  # training, as far as the launcher can tell
"""


def _alive(pid: int) -> bool:
    """Running (a zombie no one reaped yet counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False
    except OSError:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        return True


def _launch(tmp_path: Path, script: str, nproc: int, *args: str, log_rank: str = "0") -> subprocess.Popen:
    worker = tmp_path / "worker.py"
    worker.write_text(script)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(
        ["bash", str(LAUNCHER), sys.executable, "--standalone", f"--nproc_per_node={nproc}",
         "--local-ranks-filter", log_rank, "--role", "rank", "--tee", "3", str(worker), *args],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)


def test_workers_stop_when_the_launchers_process_group_is_killed(tmp_path):
    proc = _launch(tmp_path, SLEEPER, 2, str(tmp_path))
    pid_files = [tmp_path / "0.pid", tmp_path / "1.pid"]
    workers: list[int] = []
    try:
        deadline = time.monotonic() + 120
        while not all(p.is_file() and p.read_text() for p in pid_files):
            assert proc.poll() is None and time.monotonic() < deadline, "the stand-in workers did not start"
            time.sleep(0.1)
        workers = [int(p.read_text()) for p in pid_files]
        os.killpg(proc.pid, signal.SIGKILL)  # the launcher, its filter and torchrun; not the workers
        proc.communicate(timeout=30)
        deadline = time.monotonic() + 15  # each checks its parent every 0.2 s
        while any(_alive(pid) for pid in workers) and time.monotonic() < deadline:
            time.sleep(0.1)
        orphans = [pid for pid in workers if _alive(pid)]
        assert not orphans, f"workers {orphans} still run after their launcher was killed"
    finally:
        for pid in workers:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate(timeout=30)


FAILS_ON_RANK_1 = """
import os, signal, sys, time

# The launcher starts workers with SIGTERM ignored (the trainer installs its own save-and-exit handler): a
# stand-in without that handler takes the default, so torchrun's SIGTERM ends it at once, not 30 s later.
signal.signal(signal.SIGTERM, signal.SIG_DFL)
if os.environ["RANK"] == "1":
    for i in range(30):
        print(f"rank 1 line {i}", flush=True)
    if sys.argv[1] == "abort":  # as a C++ library's uncaught exception ends a process
        sys.stderr.write("rank 1 gives up: a planted failure\\n")
        sys.stderr.flush()
        os.abort()
    sys.exit("rank 1 gives up: a planted failure")
time.sleep(60)  # rank 0 trains on until torchrun stops it
"""


def _finished(proc: subprocess.Popen) -> tuple[str, str]:
    """(stdout, stderr) of a launch once it ended; one still running after 180 s is killed with its group."""
    try:
        return proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate(timeout=30)


@pytest.mark.parametrize("how", ["error", "abort"])
def test_a_failed_rank_whose_output_is_not_shown_has_its_last_lines_printed(tmp_path, how):
    proc = _launch(tmp_path, FAILS_ON_RANK_1, 2, how, log_rank="0")
    _, err = _finished(proc)
    assert proc.returncode != 0
    assert "rank 1's output is not shown (LOG_RANK); the last 20 lines of its stdout:" in err, err
    assert "[rank1]:rank 1 line 29\n" in err and "[rank1]:rank 1 line 10\n" in err
    assert "[rank1]:rank 1 line 9\n" not in err  # only the last lines
    assert "rank 1's output is not shown (LOG_RANK); the last 1 lines of its stderr:\n" in err
    assert "[rank1]:rank 1 gives up: a planted failure\n" in err
    # Its lines come before the one-line report that points up at them.
    assert err.index("gives up") < err.index("error: rank 1")


def test_a_failed_rank_whose_output_is_shown_is_not_printed_twice(tmp_path):
    proc = _launch(tmp_path, FAILS_ON_RANK_1, 2, "error", log_rank="0,1")
    out, err = _finished(proc)
    assert proc.returncode != 0
    assert "output is not shown" not in err
    assert (out + err).count("rank 1 gives up: a planted failure") == 1
