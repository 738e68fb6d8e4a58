"""Filters torchrun's stderr: its ChildFailedError block (a launcher traceback plus ~25 lines of
report, printed after every failed launch) becomes one line naming the failing rank, host, pid and
exit code. The workers' own errors and tracebacks, printed above it, pass through untouched.

    torchrun ... 2> >(python scripts/_torchrun_filter.py [--log-dir DIR --shown RANKS] >&2)

When the rank that failed first is not among the ranks whose output is shown (``--shown``, torchrun's
``--local-ranks-filter``), the last lines it wrote are printed from its log files under ``--log-dir``
(torchrun's ``--log-dir``, where ``--tee`` keeps every rank's output) just before that line.

Standard library only: it runs beside torchrun before anything is imported.
"""
from __future__ import annotations

import argparse
import glob
import os
import re
import signal
import socket
import sys
from collections.abc import Iterable, Iterator

_TRACEBACK = "Traceback (most recent call last):"
_CHILD_FAILED = "torch.distributed.elastic.multiprocessing.errors.ChildFailedError"
_FIELD = re.compile(r"^\s+(\w+)\s*: (.*?)\s*$")
_LOCAL_RANK = re.compile(r"\(local_rank: (\d+)\)")
TAIL_LINES = 20
"""Lines of each of the failed rank's stdout and stderr printed when its output was not shown."""


def _summary(report: list[str]) -> str:
    """'rank R (local_rank L) on HOST failed with exit code C (pid P)' from the Root Cause section."""
    root = report[next((i for i, line in enumerate(report) if line.startswith("Root Cause")), 0):]
    fields = dict(m.groups() for line in root if (m := _FIELD.match(line)))
    exitcode = fields.get("exitcode", "?")
    code = exitcode.split(" ", 1)[0]
    pid_match = re.search(r"\(pid: (\d+)\)", exitcode)
    pid = pid_match.group(1) if pid_match else "?"
    others = sum(1 for line in report[:report.index(root[0])] if re.match(r"^\[\d+\]:", line)) if root else 0
    also = f"; {others} other rank(s) failed after it" if others else ""
    rank = f"rank {fields.get('rank', '?')} on {fields.get('host', '?')}"
    signal_name = _signal_name(code)
    if signal_name is not None:
        # A signal stops a worker before it can print anything: "its error is printed above" would be false.
        return (f"error: {rank} was killed by signal {signal_name} first (pid {pid}){also}; a killed process prints "
                f"no error of its own: look for who sent it (the kernel's out-of-memory killer in dmesg, a kill, the "
                f"scheduler)\n")
    return f"error: {rank} failed first, exit code {code} (pid {pid}){also}: its error is printed above\n"


def _signal_name(exitcode: str) -> str | None:
    """'SIGKILL' for torchrun's exit code '-9' (a worker ended by a signal); None for an ordinary exit code."""
    try:
        number = int(exitcode)
    except ValueError:
        return None
    if number >= 0:
        return None
    try:
        return signal.Signals(-number).name
    except ValueError:
        return f"{-number}"


def _unshown_rank_tail(report: list[str], log_dir: str | None, shown: set[int] | None) -> list[str]:
    """The last lines of the failed rank's stdout and stderr logs when its output was not shown; none
    when it was, when there are no logs, or when it ran on another host (whose logs are there)."""
    if log_dir is None or shown is None:
        return []
    root = report[next((i for i, line in enumerate(report) if line.startswith("Root Cause")), 0):]
    fields = dict(m.groups() for line in root if (m := _FIELD.match(line)))
    local = _LOCAL_RANK.search(fields.get("rank", ""))
    if local is None or int(local.group(1)) in shown:
        return []
    if fields.get("host") not in (None, socket.gethostname(), socket.getfqdn()):
        return []
    attempts = glob.glob(os.path.join(log_dir, "*", "attempt_*", local.group(1)))
    if not attempts:
        return []
    folder = max(attempts, key=lambda path: int(path.split("attempt_")[-1].split(os.sep)[0]))
    rank = fields["rank"].split()[0]
    out = []
    for stream in ("stdout", "stderr"):
        try:
            with open(os.path.join(folder, f"{stream}.log"), errors="replace") as f:
                lines = f.read().splitlines()
        except OSError:
            continue
        if lines:
            out.append(f"rank {rank}'s output is not shown (LOG_RANK); the last {min(len(lines), TAIL_LINES)} "
                       f"lines of its {stream}:\n")
            out += [f"[rank{rank}]:{line}\n" for line in lines[-TAIL_LINES:]]
    return out


def filter_lines(lines: Iterable[str], *, log_dir: str | None = None, shown: set[int] | None = None) -> Iterator[str]:
    """``log_dir`` and ``shown``: see the module's docstring (both None: print no rank's log)."""
    held: list[str] = []
    it = iter(lines)
    for line in it:
        if not held:
            if line.rstrip("\n") == _TRACEBACK:
                held.append(line)
            else:
                yield line
            continue
        if line.startswith((" ", "\t")) or not line.strip():
            held.append(line)
            continue
        if line.startswith(_CHILD_FAILED):
            report = []
            rules = 0
            for rest in it:
                report.append(rest)
                rules += rest.startswith("====")
                if rules == 2:
                    break
            yield from _unshown_rank_tail(report, log_dir, shown)
            yield _summary(report)
        else:
            yield from held
            yield line
        held = []
    yield from held


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--log-dir", help="torchrun's --log-dir")
    parser.add_argument("--shown", help="torchrun's --local-ranks-filter: comma-separated local ranks")
    args = parser.parse_args()
    shown = None if args.shown is None else {int(r) for r in args.shown.split(",") if r.strip()}
    for line in filter_lines(sys.stdin, log_dir=args.log_dir, shown=shown):
        sys.stdout.write(line)
        sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
