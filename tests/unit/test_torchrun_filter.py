"""scripts/_torchrun_filter.py: torchrun's ChildFailedError report becomes one line; the rest passes."""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
from _torchrun_filter import filter_lines  # noqa: E402

WORKER = """[rank0]: Traceback (most recent call last):
[rank0]:   File "train.py", line 3, in <module>
[rank0]: ValueError: boom
Traceback (most recent call last):
  File "worker.py", line 1, in <module>
KeyError: 'x'
"""

AGENT = ("E1124 06:23:40.685000 16301 .venv/lib/python3.11/site-packages/torch/distributed/elastic/multiprocessing/"
         "api.py:1002] failed (exitcode: 1) local_rank: 0 (pid: 16319) of binary: /x/python\n")

TORCHRUN = AGENT + """Traceback (most recent call last):
  File "<frozen runpy>", line 198, in _run_module_as_main
  File "/x/torch/distributed/launcher/api.py", line 383, in launch_agent
    raise ChildFailedError(
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:{space}
============================================================
train.py FAILED
------------------------------------------------------------
Failures:
[1]:
  time      : 2026-11-24_06:23:40
  host      : node7
  rank      : 1 (local_rank: 1)
  exitcode  : 1 (pid: 16320)
  error_file: <N/A>
------------------------------------------------------------
Root Cause (first observed failure):
[0]:
  time      : 2026-11-24_06:23:40
  host      : node7
  rank      : 0 (local_rank: 0)
  exitcode  : 1 (pid: 16319)
  error_file: <N/A>
  traceback : To enable traceback see: https://pytorch.org/docs/stable/elastic/errors.html
============================================================
""".format(space=" ")  # torchrun prints a trailing space after the exception name


def test_child_failed_report_becomes_one_line_and_worker_errors_pass():
    out = "".join(filter_lines((WORKER + TORCHRUN + "after\n").splitlines(keepends=True)))
    # torchrun's one-line notice of each failed worker stays (restarts are reported with it).
    assert out == WORKER + AGENT + ("error: rank 0 (local_rank: 0) on node7 failed first, exit code 1 (pid 16319); "
                            "1 other rank(s) failed after it: its error is printed above\nafter\n")


def test_unfinished_traceback_is_not_lost():
    text = "Traceback (most recent call last):\n  File \"x.py\", line 1\n"
    assert "".join(filter_lines(text.splitlines(keepends=True))) == text


def test_a_rank_killed_by_a_signal_is_named_as_such_not_as_an_error_printed_above():
    # A SIGKILLed worker prints nothing; torchrun reports exit code -9 and the signal in its traceback field.
    killed = TORCHRUN.replace("exitcode  : 1 (pid: 16319)", "exitcode  : -9 (pid: 16319) SIGKILL").replace(
        "  traceback : To enable traceback see: https://pytorch.org/docs/stable/elastic/errors.html",
        "  traceback : Signal 9 (SIGKILL) received by PID 16319")
    out = "".join(filter_lines(killed.splitlines(keepends=True)))
    assert out == AGENT + (
        "error: rank 0 (local_rank: 0) on node7 was killed by signal SIGKILL first (pid 16319); 1 other rank(s) failed "
        "after it; a killed process prints no error of its own: look for who sent it (the kernel's out-of-memory "
        "killer in dmesg, a kill, the scheduler)\n")
    assert "printed above" not in out
