"""Does a revision of the project train exactly as another does, in every family and parallel layout?

    python scripts/layout_equivalence.py --baseline c2ed09b
    python scripts/layout_equivalence.py --baseline main~3 --families llama3 --layouts 1 tp2

For each family's debug config and each layout (1 process, FSDP 2, TP 2, EP 2, PP 2, PP 2 x EP 2; the EP
layouts only where the family has experts) it trains the baseline revision's source (``git archive``d into the
output folder) and the checkout's, float32, deterministic, from the same seed, and compares:

- the initial model state, every rank's shards gathered: bitwise equal, tensor by tensor;
- the loss of each of the first ``--steps`` steps: equal within ``--rtol`` relative (1e-6: float32 runs of the
  same arithmetic are bitwise equal; the bound leaves room only for a changed summation order).

A refactor that claims to change nothing runs this against the revision before it. Each run is one torchrun
launch of scripts/_equivalence_worker.py with the side's source first on PYTHONPATH; it prints one line per
(family, layout) and exits 1 if any differs.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from torchtitan_lite.tools.loss_compare_runs import CompareError, read_losses
from torchtitan_lite.tools.repo import REPO_ROOT, SCRIPTS_DIR

LAYOUTS: dict[str, tuple[int, tuple[str, ...], bool]] = {
    # name: (processes, flags, needs experts)
    "1": (1, (), False),
    "fsdp2": (2, ("--parallelism.dp_shard", "2"), False),
    "tp2": (2, ("--parallelism.tp", "2"), False),
    "ep2": (2, ("--parallelism.ep", "2"), True),
    "pp2": (2, ("--parallelism.pp", "2"), False),
    "pp2_ep2": (4, ("--parallelism.pp", "2", "--parallelism.ep", "2"), True),
}
FAMILIES: dict[str, bool] = {"llama3": False, "qwen3_moe": True, "deepseek_v3": True}
"""family -> whether its debug config has experts."""

RUN = ("--training.seq_len", "64", "--training.local_batch_size", "4", "--training.seed", "0",
       "--debug.deterministic", "true", "--precision.param_dtype", "float32", "--precision.reduce_dtype", "float32",
       "--validation.enable", "false", "--metrics.log_freq", "1", "--checkpoint.enable", "false")


@dataclasses.dataclass
class Outcome:
    family: str
    layout: str
    initial: str
    """"equal (N tensors)" or what differs."""
    loss_rel_diff: float | None
    """Largest relative difference of the step losses; None when a side has no losses."""
    ok: bool
    seconds: float

    def line(self) -> str:
        losses = "no losses" if self.loss_rel_diff is None else f"losses max rel diff {self.loss_rel_diff:.2e}"
        return (f"{'PASS' if self.ok else 'FAIL'}  {self.family:<12} {self.layout:<8} initial state {self.initial}; "
                f"{losses} ({self.seconds:.0f} s)")


def planned(families: list[str], layouts: list[str]) -> list[tuple[str, str]]:
    """(family, layout) pairs to compare: expert parallelism only where the family has experts."""
    return [(f, layout) for f in families for layout in layouts if FAMILIES[f] or not LAYOUTS[layout][2]]


def source_of(revision: str, folder: Path) -> tuple[str, Path]:
    """(commit, its tree as plain files under ``folder``/commit): extracted once per commit (a name such as
    main~1 moves, so what is kept goes by the commit it names), without touching the checkout's git state."""
    commit = subprocess.run(["git", "rev-parse", "--verify", f"{revision}^{{commit}}"], cwd=REPO_ROOT,
                            capture_output=True, text=True, check=True).stdout.strip()
    into = folder / commit
    if not (into / "train.py").exists():
        into.mkdir(parents=True, exist_ok=True)
        archive = subprocess.run(["git", "archive", commit], cwd=REPO_ROOT, capture_output=True, check=True).stdout
        subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    return commit, into


def train(source: Path, revision: str, family: str, layout: str, steps: int, folder: Path) -> str | None:
    """Train one side into ``folder``; None when it finished, else the last lines of its output. A folder that
    holds a finished run of the same revision and command is reused (the baseline's runs serve many checks)."""
    nproc, flags, _ = LAYOUTS[layout]
    args = ["--config", f"{family}_debug", "--training.steps", str(steps), *RUN, *flags,
            "--job.dump_folder", str(folder)]
    marker = folder / "finished.json"
    identity = {"revision": revision, "nproc": nproc, "args": args}
    if revision != "checkout" and marker.exists() and json.loads(marker.read_text()) == identity:
        return None
    if folder.exists():
        shutil.rmtree(folder)
    folder.mkdir(parents=True)
    worker = str(SCRIPTS_DIR / "_equivalence_worker.py")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", worker,
           str(folder / "initial"), *args]
    env = {**os.environ, "PYTHONPATH": str(source), "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    result = subprocess.run(cmd, cwd=folder, env=env, capture_output=True, text=True)
    (folder / "output.txt").write_text(result.stdout + result.stderr)
    if result.returncode != 0:
        return " | ".join((result.stdout + result.stderr).strip().splitlines()[-2:])
    marker.write_text(json.dumps(identity))
    return None


def initial_state(folder: Path) -> dict:
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    with tempfile.TemporaryDirectory() as tmp:
        dcp_to_torch_save(str(folder / "initial"), f"{tmp}/state.pt")
        return torch.load(f"{tmp}/state.pt", weights_only=True)["model"]


def state_difference(a: dict, b: dict) -> str | None:
    """None when every tensor is bitwise equal (same keys, dtypes, shapes, values); else what differs."""
    import torch

    if set(a) != set(b):
        return f"keys differ: {sorted(set(a) ^ set(b))[:5]}"
    unequal = [k for k in sorted(a) if not (a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]))]
    return f"{len(unequal)} tensors differ, first {unequal[:3]}" if unequal else None


def step_losses(folder: Path) -> dict[int, float]:
    """The run's logged step losses; none when it logged none (judged unequal)."""
    try:
        return read_losses(folder)
    except CompareError:
        return {}


def largest_relative_difference(a: dict[int, float], b: dict[int, float]) -> float | None:
    if not a or set(a) != set(b):
        return None
    return max(abs(a[s] - b[s]) / abs(b[s]) for s in a)


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--baseline", required=True, help="git revision to compare against")
    p.add_argument("--current", default=None, help="git revision to compare (default: the checkout's files)")
    p.add_argument("--families", nargs="+", default=list(FAMILIES), choices=list(FAMILIES))
    p.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--rtol", type=float, default=1e-6)
    p.add_argument("--out", type=Path, default=None, help="folder for the runs (default: a new temporary one)")
    return p.parse_args(argv)


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    out = args.out or Path(tempfile.mkdtemp(prefix="layout_equivalence_"))
    sides = {"baseline": source_of(args.baseline, out / "baseline" / "src"),
             "current": ("checkout", REPO_ROOT) if args.current is None
             else source_of(args.current, out / "current" / "src")}
    print(f"baseline {args.baseline} vs {args.current or f'the checkout at {REPO_ROOT}'}; runs under {out}",
          flush=True)
    outcomes = []
    for family, layout in planned(args.families, args.layouts):
        runs = {name: out / name / family / layout for name in sides}
        outcome = _compare_sides(sides, runs, family, layout, args)
        print(outcome.line(), flush=True)
        outcomes.append(outcome)
    failed = [o for o in outcomes if not o.ok]
    (out / "outcomes.json").write_text(json.dumps([dataclasses.asdict(o) for o in outcomes], indent=1))
    print(f"{len(outcomes) - len(failed)} of {len(outcomes)} layouts equal", flush=True)
    return 1 if failed else 0


def _compare_sides(sides: dict[str, tuple[str, Path]], runs: dict[str, Path], family: str, layout: str,
                   args: argparse.Namespace) -> Outcome:
    start = time.monotonic()
    for name, (revision, source) in sides.items():
        if (tail := train(source, revision, family, layout, args.steps, runs[name])) is not None:
            return Outcome(family, layout, f"the {name} run failed: {tail}", None, False, time.monotonic() - start)
    a, b = initial_state(runs["baseline"]), initial_state(runs["current"])
    differs = state_difference(a, b)
    losses = {name: step_losses(folder) for name, folder in runs.items()}
    rel = largest_relative_difference(losses["current"], losses["baseline"])
    ok = differs is None and rel is not None and rel <= args.rtol and len(losses["current"]) == args.steps
    return Outcome(family, layout, differs or f"bitwise equal ({len(a)} tensors)", rel, ok, time.monotonic() - start)
