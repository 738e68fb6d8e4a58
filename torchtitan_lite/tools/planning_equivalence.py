"""Do two revisions plan the same? ``--estimate-memory`` and ``--dry-run`` text, compared line by line.

    python scripts/planning_equivalence.py --baseline c2ed09b

It runs, in each revision's own source (``git archive``d; the checkout for the current side):
- every ``./run_train.sh ... --dry-run`` / ``--estimate-memory`` command written in README.md and docs/*.md
  (with its ``NGPU=``), and
- every registered config with ``--estimate-memory`` and with ``--dry-run`` on 8 processes,
and prints, for each command whose output differs, a unified diff (clock times, durations and logger names
removed). A refactor that claims
to change no plan runs it against the revision before it; the differences it expects are the ones it names.
"""
from __future__ import annotations

import argparse
import difflib
import json
import os
import re
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

from torchtitan_lite.tools.layout_equivalence import source_of
from torchtitan_lite.tools.repo import REPO_ROOT

DOCUMENTED = re.compile(r"((?:NGPU=\d+ )?\./run_train\.sh [^`\n]*--(?:dry-run|estimate-memory)\b[^`\n]*)")
CLOCK = re.compile(r"\b\d\d:\d\d:\d\d(?:[.,]\d+)?\b")
DURATION = re.compile(r"\bin \d+(?:\.\d+)?s\b")
LOGGER = re.compile(r"\b(DEBUG|INFO|WARNING|ERROR) [\w.]+:")
"""What varies from run to run or names where a line is written from: clock times, durations, logger names."""


def documented_commands(root: Path) -> list[tuple[dict[str, str], list[str]]]:
    """(environment, train.py arguments) of each planning command the docs show, in order, without repeats."""
    found: list[tuple[dict[str, str], list[str]]] = []
    for doc in [root / "README.md", *sorted((root / "docs").glob("*.md"))]:
        for text in DOCUMENTED.findall(doc.read_text()):
            if "..." in text or "<" in text:
                continue  # a template, not a command
            words = shlex.split(text)
            env = dict(w.split("=", 1) for w in words if re.fullmatch(r"[A-Z_]+=\S+", w))
            args = words[words.index("./run_train.sh") + 1:]
            if (env, args) not in found:
                found.append((env, args))
    return found


def registry_commands(names: list[str]) -> list[tuple[dict[str, str], list[str]]]:
    return [({"NGPU": "8"}, ["--config", name, action]) for name in names for action in ("--estimate-memory",
                                                                                         "--dry-run")]


def registered_configs(source: Path) -> list[str]:
    code = "import models\nfrom config_registry import DEFAULT_REGISTRY as R\nprint('\\n'.join(sorted(R.names())))"
    out = subprocess.run([sys.executable, "-c", code], env={**os.environ, "PYTHONPATH": str(source)},
                         capture_output=True, text=True, check=True).stdout
    return out.split()


def plan_text(source: Path, env: dict[str, str], args: list[str]) -> str:
    """The command's output and exit status, clock times removed, run in the side's own train.py."""
    result = subprocess.run([sys.executable, str(source / "train.py"), *args], cwd=tempfile.gettempdir(),
                            env={**os.environ, **env, "PYTHONPATH": str(source), "OMP_NUM_THREADS": "1"},
                            capture_output=True, text=True, timeout=900)
    return normalised(f"{result.stdout}{result.stderr}exit {result.returncode}\n")


def normalised(text: str) -> str:
    return LOGGER.sub(r"\1 <logger>:", DURATION.sub("in Ns", CLOCK.sub("HH:MM:SS", text)))


def texts(source: Path, commands: list[tuple[dict[str, str], list[str]]], cache: Path | None) -> list[str]:
    if cache is not None and cache.exists():
        held = json.loads(cache.read_text())
        if held["commands"] == commands:
            return held["texts"]
    out = [plan_text(source, env, args) for env, args in commands]
    if cache is not None:
        cache.write_text(json.dumps({"commands": commands, "texts": out}))
    return out


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--baseline", required=True, help="git revision to compare against")
    p.add_argument("--out", type=Path, default=None, help="folder for the sources and the baseline's texts")
    return p.parse_args(argv)


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    out = args.out or Path(tempfile.mkdtemp(prefix="planning_equivalence_"))
    commit, baseline = source_of(args.baseline, out / "baseline" / "src")
    commands = documented_commands(REPO_ROOT) + registry_commands(registered_configs(REPO_ROOT))
    print(f"{len(commands)} planning commands, baseline {args.baseline} vs the checkout; runs under {out}", flush=True)
    before = [normalised(t) for t in texts(baseline, commands, out / f"baseline-{commit}.json")]
    after = texts(REPO_ROOT, commands, None)
    differing = 0
    for (env, cmd), a, b in zip(commands, before, after):
        if a == b:
            continue
        differing += 1
        title = " ".join([*(f"{k}={v}" for k, v in env.items()), "train.py", *cmd])
        print(f"\n=== {title}")
        sys.stdout.writelines(difflib.unified_diff(a.splitlines(True), b.splitlines(True), "baseline", "checkout",
                                                   n=0))
    print(f"\n{len(commands) - differing} of {len(commands)} planning outputs equal", flush=True)
    return 1 if differing else 0
