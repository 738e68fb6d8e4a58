"""Compare the loss curves of two or more configs (or finished runs) against the first one.

    python scripts/loss_compare.py --configs llama3_debug_bf16 llama3_debug_fp8 llama3_debug_fp8_rowwise
    python scripts/loss_compare.py --configs llama3_debug llama3_debug_fp8 --steps 50 \
        -- --precision.param_dtype float32 --model.n_layers 2
    python scripts/loss_compare.py --runs outputs/bf16 outputs/fp8 --last 50

With ``--configs`` each config trains in its own folder ``<dump-root>/<config>`` (train.py, or
run_train.sh with ``--nproc`` > 1) with every step logged; arguments after ``--`` are config
overrides passed to every run. With ``--runs`` the TensorBoard scalars of finished runs are read
(``<run>/tb`` or the TensorBoard folder itself). The first config / run is the baseline.

Writes a PNG with the loss curves and the per-step gap to the baseline (``--out``) and a markdown
table of the per-step losses and gaps (``--table``), then prints, per config, the mean |gap| over
the last ``--last`` steps that all runs logged. Exit status: 0 when every mean |gap| is within
``--tolerance``, 1 when one exceeds it, 2 when a run fails or the input is unusable.
"""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from torchtitan_lite.tools.repo import REPO_ROOT

LOSS_TAG = "train/loss"
OWNED_MARKER = ".loss_compare"
"""Written into each run folder this script creates: only such folders are ever cleared for a rerun."""
CONTROLLED_KEYS = ("--job.dump_folder", "--metrics.log_freq", "--metrics.enable_tensorboard",
                   "--metrics.save_tb_folder", "--metrics.rank_0_only")
"""Overrides the script sets itself so that every step lands in <dump-root>/<config>/tb."""
EXIT_OK, EXIT_GAP, EXIT_ERROR = 0, 1, 2


class CompareError(RuntimeError):
    """Bad input or a failed run; the message says what to fix."""


@dataclass(frozen=True)
class GapSummary:
    label: str
    steps: list[int]
    """The last-N common steps the means are taken over."""
    mean_abs_gap: float
    mean_gap: float
    """Signed: positive means the loss is higher than the baseline's."""
    final_gap: float


# --------------------------------------------------------------------------------------------------
# Reading losses


def tensorboard_folder(run: Path) -> Path:
    """``<run>/tb`` when it exists, else ``run`` itself (a TensorBoard folder given directly)."""
    tb = run / "tb"
    return tb if tb.is_dir() else run


def read_losses(run: Path, tag: str = LOSS_TAG) -> dict[int, float]:
    """step -> value of ``tag`` from the TensorBoard event files of ``run``; the last write of a step wins."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    folder = tensorboard_folder(run)
    if not folder.is_dir() or not any(p.name.startswith("events.out.tfevents") for p in folder.iterdir()):
        raise CompareError(f"{run}: no TensorBoard event files in {folder}; give a run's dump folder (with tb/) "
                           f"or its TensorBoard folder")
    acc = EventAccumulator(str(folder), size_guidance={"scalars": 0})
    acc.Reload()
    if tag not in acc.Tags()["scalars"]:
        raise CompareError(f"{folder} has no '{tag}' scalar (it has {sorted(acc.Tags()['scalars'])})")
    return {event.step: event.value for event in acc.Scalars(tag)}


# --------------------------------------------------------------------------------------------------
# Gap arithmetic


def common_steps(curves: dict[str, dict[int, float]]) -> list[int]:
    """Steps logged by every run, ascending."""
    steps = set.intersection(*(set(curve) for curve in curves.values()))
    return sorted(steps)


def summarize_gaps(curves: dict[str, dict[int, float]], last: int) -> list[GapSummary]:
    """Per non-baseline curve: mean |gap|, mean gap and final gap to the first curve over the last ``last``
    common steps."""
    labels = list(curves)
    steps = common_steps(curves)
    if not steps:
        raise CompareError(f"the runs share no logged step ({', '.join(f'{k}: {_span(v)}' for k, v in curves.items())})")
    window = steps[-last:]
    base = curves[labels[0]]
    summaries = []
    for label in labels[1:]:
        gaps = [curves[label][s] - base[s] for s in window]
        summaries.append(GapSummary(label, window, sum(abs(g) for g in gaps) / len(gaps), sum(gaps) / len(gaps),
                                    gaps[-1]))
    return summaries


def _span(curve: dict[int, float]) -> str:
    return f"steps {min(curve)}..{max(curve)}" if curve else "no steps"


# --------------------------------------------------------------------------------------------------
# Outputs


def write_table(curves: dict[str, dict[int, float]], summaries: list[GapSummary], path: Path, *,
                tolerance: float) -> None:
    """Markdown: a summary table, then one row per common step with every loss and its gap to the baseline."""
    labels = list(curves)
    base_label = labels[0]
    window = summaries[0].steps
    lines = [f"# Loss gap vs {base_label}", "",
             f"Mean over the last {len(window)} common steps ({window[0]}..{window[-1]}); tolerance {tolerance:g} "
             f"on mean |gap|.", "",
             "| config | mean \\|gap\\| | mean gap | final gap | within tolerance |", "|---|---:|---:|---:|---|"]
    for s in summaries:
        ok = "yes" if s.mean_abs_gap <= tolerance else "**no**"
        lines.append(f"| {s.label} | {s.mean_abs_gap:.4f} | {s.mean_gap:+.4f} | {s.final_gap:+.4f} | {ok} |")
    header = ["step", base_label]
    for label in labels[1:]:
        header += [label, f"gap {label}"]
    lines += ["", "| " + " | ".join(header) + " |", "|" + "---:|" * len(header)]
    base = curves[base_label]
    for step in common_steps(curves):
        row = [str(step), f"{base[step]:.4f}"]
        for label in labels[1:]:
            row += [f"{curves[label][step]:.4f}", f"{curves[label][step] - base[step]:+.4f}"]
        lines.append("| " + " | ".join(row) + " |")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")


def write_plot(curves: dict[str, dict[int, float]], path: Path, *, last: int) -> None:
    """Top: every loss curve; bottom: the per-step gap to the baseline, with the averaging window shaded."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = list(curves)
    base = curves[labels[0]]
    steps = common_steps(curves)
    fig, (ax_loss, ax_gap) = plt.subplots(2, 1, figsize=(9, 7), sharex=True, gridspec_kw={"height_ratios": [2, 1]})
    for label, curve in curves.items():
        xs = sorted(curve)
        ax_loss.plot(xs, [curve[s] for s in xs], label=label, linewidth=1.2)
    ax_loss.set_ylabel(LOSS_TAG)
    ax_loss.legend()
    ax_loss.grid(alpha=0.3)
    for label in labels[1:]:
        ax_gap.plot(steps, [curves[label][s] - base[s] for s in steps], label=f"{label} - {labels[0]}", linewidth=1.0)
    ax_gap.axhline(0.0, color="black", linewidth=0.6)
    window = steps[-last:]
    ax_gap.axvspan(window[0], window[-1], color="grey", alpha=0.15, label=f"last {len(window)} steps")
    ax_gap.set_xlabel("step")
    ax_gap.set_ylabel("loss gap")
    ax_gap.legend()
    ax_gap.grid(alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


# --------------------------------------------------------------------------------------------------
# Running configs


def check_passthrough(overrides: list[str], *, steps: int | None) -> None:
    """Reject overrides the script controls itself, with the flag to use instead."""
    for token in overrides:
        key = token.partition("=")[0]
        if key in CONTROLLED_KEYS:
            raise CompareError(f"{key} is set by loss_compare (every step is logged to <dump-root>/<config>/tb); "
                               f"remove it, and use --dump-root to choose where the runs go")
        if key == "--training.steps" and steps is not None:
            raise CompareError("give the number of steps once: --steps N or the override --training.steps N")
    if overrides and not overrides[0].startswith("--"):
        raise CompareError(f"overrides after '--' are --section.field VALUE pairs, got {overrides[0]!r} first")


def train_command(config: str, dump: Path, *, steps: int | None, overrides: list[str], nproc: int) -> list[str]:
    """The command line that trains ``config`` into ``dump`` with every step logged to TensorBoard."""
    args = ["--config", config, *overrides, "--job.dump_folder", str(dump), "--metrics.log_freq", "1",
            "--metrics.enable_tensorboard", "true", "--metrics.save_tb_folder", "tb", "--metrics.rank_0_only", "true"]
    if steps is not None:
        args += ["--training.steps", str(steps)]
    if nproc > 1:
        return [str(REPO_ROOT / "run_train.sh"), *args]
    return [sys.executable, str(REPO_ROOT / "train.py"), *args]


def prepare_run_folder(dump: Path) -> None:
    """An empty folder for the run; a folder from an earlier loss_compare run is cleared, any other
    non-empty folder is refused (it could hold a checkpoint the run would resume from)."""
    if dump.exists() and any(dump.iterdir()):
        if not (dump / OWNED_MARKER).exists():
            raise CompareError(f"{dump} exists and was not written by loss_compare; choose another --dump-root "
                               f"or remove it")
        shutil.rmtree(dump)
    dump.mkdir(parents=True, exist_ok=True)
    (dump / OWNED_MARKER).write_text("run folder of scripts/loss_compare.py; cleared on its next run\n")


def run_config(config: str, dump: Path, *, steps: int | None, overrides: list[str], nproc: int) -> None:
    """Train ``config`` into ``dump``; its console output goes to ``dump/train.log``."""
    prepare_run_folder(dump)
    cmd = train_command(config, dump, steps=steps, overrides=overrides, nproc=nproc)
    env = dict(os.environ, NPROC=str(nproc))
    # run_train.sh would otherwise look for (or build) its own environment.
    env.setdefault("TTL_PYTHON", sys.executable)
    log_path = dump / "train.log"
    print(f"[loss_compare] {config}: {' '.join(cmd)}", flush=True)
    start = time.perf_counter()
    with open(log_path, "w") as log:
        proc = subprocess.run(cmd, cwd=REPO_ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    elapsed = time.perf_counter() - start
    if proc.returncode != 0:
        tail = "".join(log_path.read_text().splitlines(keepends=True)[-25:])
        raise CompareError(f"training {config} failed (exit {proc.returncode}) after {elapsed:.0f}s; "
                           f"last lines of {log_path}:\n{tail}")
    print(f"[loss_compare] {config}: done in {elapsed:.0f}s", flush=True)


# --------------------------------------------------------------------------------------------------


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    """This tool's flags, checked, and the config overrides after ``--``."""
    overrides: list[str] = []
    if "--" in argv:
        split = argv.index("--")
        argv, overrides = argv[:split], argv[split + 1:]
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     usage="%(prog)s (--configs A B [C ...] | --runs DIR_A DIR_B [...]) [options] "
                                           "[-- --section.field VALUE ...]")
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--configs", nargs="+", metavar="NAME", help="registered configs to train; the first is the baseline")
    source.add_argument("--runs", nargs="+", metavar="DIR", type=Path,
                        help="finished runs (dump folders with tb/, or TensorBoard folders); the first is the baseline")
    parser.add_argument("--steps", type=int, default=None, help="training steps per config (default: each config's own)")
    parser.add_argument("--last", type=int, default=20, help="number of final common steps the gap is averaged over")
    parser.add_argument("--tolerance", type=float, default=0.05, help="largest acceptable mean |loss gap| (nats)")
    parser.add_argument("--out", type=Path, default=Path("loss_compare.png"), help="PNG plot to write")
    parser.add_argument("--table", type=Path, default=None,
                        help="markdown table to write (default: beside --out, with .md for .png)")
    parser.add_argument("--dump-root", type=Path, default=Path("outputs/loss_compare"),
                        help="runs go to <dump-root>/<config> (with --configs)")
    parser.add_argument("--nproc", type=int, default=1, help="processes per run; > 1 launches run_train.sh (torchrun)")
    args = parser.parse_args(argv)
    names = args.configs or [str(r) for r in args.runs]
    if len(names) < 2:
        parser.error("give at least two configs or runs to compare")
    if len(set(names)) != len(names):
        parser.error(f"each config / run may appear once, got {names}")
    if args.runs and overrides:
        parser.error("overrides after '--' apply to --configs runs only")
    if args.steps is not None and args.steps < 1:
        parser.error(f"--steps must be >= 1, got {args.steps}")
    if args.last < 1:
        parser.error(f"--last must be >= 1, got {args.last}")
    if not args.tolerance >= 0:
        parser.error(f"--tolerance must be >= 0, got {args.tolerance}")
    if args.nproc < 1:
        parser.error(f"--nproc must be >= 1, got {args.nproc}")
    if args.table is None:
        args.table = args.out.with_suffix(".md")
    return args, overrides


def collect_curves(args: argparse.Namespace, overrides: list[str]) -> dict[str, dict[int, float]]:
    """label -> step -> loss of every run: read from ``--runs``, or trained from ``--configs`` first."""
    if args.runs:
        return {str(run): read_losses(run) for run in args.runs}
    check_passthrough(overrides, steps=args.steps)
    curves = {}
    for config in args.configs:
        dump = args.dump_root / config
        run_config(config, dump, steps=args.steps, overrides=overrides, nproc=args.nproc)
        curves[config] = read_losses(dump)
    return curves


def main(argv: list[str]) -> int:
    """Compare the curves ``argv`` names; exit status 0 (within tolerance), 1 (a gap exceeds it) or 2 (error)."""
    args, overrides = parse_args(argv)
    try:
        curves = collect_curves(args, overrides)
        summaries = summarize_gaps(curves, args.last)
    except CompareError as err:
        print(f"error: {err}", file=sys.stderr)
        return EXIT_ERROR
    write_plot(curves, args.out, last=args.last)
    write_table(curves, summaries, args.table, tolerance=args.tolerance)
    baseline = next(iter(curves))
    window = summaries[0].steps
    print(f"baseline {baseline}; mean over the last {len(window)} common steps ({window[0]}..{window[-1]}):")
    failed = []
    for s in summaries:
        verdict = "ok" if s.mean_abs_gap <= args.tolerance else f"EXCEEDS tolerance {args.tolerance:g}"
        print(f"  {s.label}: mean |gap| {s.mean_abs_gap:.4f}, mean gap {s.mean_gap:+.4f}, "
              f"final gap {s.final_gap:+.4f} -> {verdict}")
        if s.mean_abs_gap > args.tolerance:
            failed.append(s.label)
    print(f"plot: {args.out}; table: {args.table}")
    if failed:
        print(f"error: mean |loss gap| to {baseline} exceeds {args.tolerance:g} for: {', '.join(failed)}",
              file=sys.stderr)
        return EXIT_GAP
    return EXIT_OK

