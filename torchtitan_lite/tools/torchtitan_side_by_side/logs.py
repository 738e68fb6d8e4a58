"""Running each trainer with its console output in a log file, and reading throughput back from both
trainers' logs."""
from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

from torchtitan_lite.tools.repo import REPO_ROOT

ANSI = re.compile(r"\x1b\[[0-9;]*m")
TORCHTITAN_STEP = re.compile(r"step:\s*(\d+)\s.*?tps:\s*([\d,]+)")
OURS_STEP = re.compile(r"step\s+(\d+)\s.*?tok/s\s+([\d,]+)")


def run_logged(cmd: list[str], log: Path, what: str, env: dict[str, str] | None = None) -> str:
    """Run ``cmd`` in the repository with its output in ``log``; the log text, or exit with its tail on failure."""
    print(f"running {what} ...", flush=True)
    full_env = dict(os.environ, PYTHONUNBUFFERED="1", HF_DATASETS_DISABLE_PROGRESS_BARS="1", **(env or {}))
    with open(log, "w") as out:
        result = subprocess.run(cmd, cwd=REPO_ROOT, stdout=out, stderr=subprocess.STDOUT, env=full_env)
    text = log.read_text()
    if result.returncode != 0:
        tail = "".join(text.splitlines(keepends=True)[-40:])
        raise SystemExit(f"error: {what} failed (exit {result.returncode}); last lines of {log}:\n{tail}")
    return text


def parse_throughput(log: str, pattern: re.Pattern[str]) -> dict[int, float]:
    """step -> tokens/s of the interval that ends at that logged step."""
    found = {}
    for line in ANSI.sub("", log).splitlines():
        match = pattern.search(line)
        if match:
            found[int(match.group(1))] = float(match.group(2).replace(",", ""))
    return found


def steady_tokens_per_s(per_log: dict[int, float], warmup: int) -> float:
    """Tokens / time over the log intervals after ``warmup``.

    Every such interval holds the same number of steps and so of tokens, which makes the combined
    rate the harmonic mean of the intervals' rates.
    """
    rates = [rate for step, rate in sorted(per_log.items()) if step > warmup]
    if not rates:
        raise ValueError(f"no throughput was logged after step {warmup}; logged steps: {sorted(per_log)}")
    return len(rates) / sum(1.0 / rate for rate in rates)
