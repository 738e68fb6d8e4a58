"""Filters torchrun's stderr: its ChildFailedError block (a launcher traceback plus ~25 lines of
report, printed after every failed launch) becomes one line naming the failing rank, host, pid and
exit code. The workers' own errors and tracebacks, printed above it, pass through untouched.

    torchrun ... 2> >(python scripts/_torchrun_filter.py >&2)

Standard library only: it runs beside torchrun before anything is imported.
"""
from __future__ import annotations

import re
import signal
import sys
from collections.abc import Iterable, Iterator

_TRACEBACK = "Traceback (most recent call last):"
_CHILD_FAILED = "torch.distributed.elastic.multiprocessing.errors.ChildFailedError"
_FIELD = re.compile(r"^\s+(\w+)\s*: (.*?)\s*$")


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


def filter_lines(lines: Iterable[str]) -> Iterator[str]:
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
            yield _summary(report)
        else:
            yield from held
            yield line
        held = []
    yield from held


def main() -> int:
    for line in filter_lines(sys.stdin):
        sys.stdout.write(line)
        sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
