"""Where two trainers spend a step: per-op self time from two torch.profiler Chrome traces.

    python scripts/trace_compare.py A_TRACE.json B_TRACE.json --labels torchtitan torchtitan_lite

Each trace is what ``torch.profiler`` exports (torchtitan's ``--profiling.enable_profiling`` and ours
write them under the run folder, torchtitan gzipped); a folder is searched for its newest ``*.json`` or
``*.json.gz``. CPU ops
(``cpu_op``) and annotations are nested per thread to get each op's self time (its duration minus
the ops it called), summed by name and divided by the number of ``ProfilerStep#`` windows in the
trace. The table lists the ops whose self time differs most between the two, in ms per step, so the
gap between two step times is accounted for op by op.
"""
from __future__ import annotations

import argparse
import gzip
import json
import sys
from collections import defaultdict
from pathlib import Path

_KINDS = ("cpu_op", "user_annotation", "python_function")


def load_events(path: Path) -> list[dict]:
    """The complete ("X") events of a Chrome trace file (plain or gzipped), or of the newest one in a folder."""
    if path.is_dir():
        files = sorted([*path.rglob("*.json"), *path.rglob("*.json.gz")], key=lambda p: p.stat().st_mtime)
        if not files:
            raise FileNotFoundError(f"no *.json or *.json.gz trace under {path}")
        path = files[-1]
    try:
        raw = gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_bytes()
        trace = json.loads(raw)
    except (json.JSONDecodeError, gzip.BadGzipFile, UnicodeDecodeError) as err:
        raise ValueError(f"{path} is not a JSON Chrome trace ({err})") from err
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    return [e for e in events if e.get("ph") == "X" and e.get("cat") in _KINDS and "dur" in e]


def self_times_per_step(events: list[dict]) -> tuple[dict[str, float], float, int]:
    """(op name -> self time in ms per step, step time in ms, number of steps) of one trace."""
    steps = [e for e in events if e["name"].startswith("ProfilerStep#")]
    if not steps:
        raise ValueError("the trace has no ProfilerStep# window; record it with torch.profiler's schedule")
    totals: dict[str, float] = defaultdict(float)
    by_thread: dict[object, list[dict]] = defaultdict(list)
    for e in events:
        if not e["name"].startswith("ProfilerStep#"):
            by_thread[(e.get("pid"), e.get("tid"))].append(e)
    for thread_events in by_thread.values():
        # Parents start first and, at equal start, last longer: a stack of open intervals gives nesting.
        thread_events.sort(key=lambda e: (e["ts"], -e["dur"]))
        stack: list[tuple[dict, float]] = []  # (event, its children's summed duration)
        for e in thread_events:
            while stack and e["ts"] >= stack[-1][0]["ts"] + stack[-1][0]["dur"]:
                _close(stack, totals)
            stack.append((e, 0.0))
        while stack:
            _close(stack, totals)
    n = len(steps)
    step_ms = sum(e["dur"] for e in steps) / n / 1e3
    return {name: us / n / 1e3 for name, us in totals.items()}, step_ms, n


def _close(stack: list[tuple[dict, float]], totals: dict[str, float]) -> None:
    event, children = stack.pop()
    totals[event["name"]] += max(event["dur"] - children, 0.0)
    if stack:
        parent, parent_children = stack[-1]
        stack[-1] = (parent, parent_children + event["dur"])


def compare_table(a: dict[str, float], b: dict[str, float], labels: tuple[str, str], top: int) -> str:
    """Markdown table of the ``top`` ops whose self time per step differs most between ``a`` and ``b``."""
    # Ties (to the ns) in name order, so the table is stable.
    names = sorted(set(a) | set(b), key=lambda n: (-round(abs(a.get(n, 0.0) - b.get(n, 0.0)), 6), n))[:top]
    rows = [f"| op (self time) | {labels[0]} ms/step | {labels[1]} ms/step | {labels[0]} - {labels[1]} |",
            "|---|---|---|---|"]
    for name in names:
        x, y = a.get(name, 0.0), b.get(name, 0.0)
        rows.append(f"| `{name}` | {x:.2f} | {y:.2f} | {x - y:+.2f} |")
    return "\n".join(rows)


def main(argv: list[str]) -> int:
    """Print the step times and the per-op table of the two traces in ``argv``; 2 on unreadable input."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("traces", nargs=2, type=Path, help="two Chrome trace files (or folders holding them)")
    parser.add_argument("--labels", nargs=2, default=["A", "B"], help="names of the two traces")
    parser.add_argument("--top", type=int, default=20, help="ops listed (largest differences first)")
    args = parser.parse_args(argv)
    try:
        loaded = [self_times_per_step(load_events(path)) for path in args.traces]
    except (OSError, ValueError, KeyError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    (a, a_step, a_n), (b, b_step, b_n) = loaded
    print(f"step time: {args.labels[0]} {a_step:.1f} ms ({a_n} step(s) traced), "
          f"{args.labels[1]} {b_step:.1f} ms ({b_n} step(s) traced), difference {a_step - b_step:+.1f} ms\n")
    print(compare_table(a, b, tuple(args.labels), args.top))
    return 0

