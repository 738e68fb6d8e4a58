"""Compare the loss curves of two or more configs (or finished runs) against the first one.

    python scripts/loss_compare.py --configs llama3_debug_bf16 llama3_debug_fp8 llama3_debug_fp8_rowwise
    python scripts/loss_compare.py --configs llama3_debug_bf16 llama3_debug_fp8 --seeds 3 --last 20
    python scripts/loss_compare.py --configs llama3_debug llama3_debug_fp8 --steps 50 \
        -- --precision.param_dtype float32 --model.n_layers 2
    python scripts/loss_compare.py --runs outputs/loss_compare/llama3_debug_bf16 outputs/loss_compare/llama3_debug_fp8 --last 50
    python scripts/loss_compare.py --verdict llama3 --seeds 4 --parallel 2   # the FP8 verdict: fp8_verdict.py

With ``--configs`` each config trains in its own folder ``<dump-root>/<config>`` (train.py, or
run_train.sh with ``--nproc`` > 1) with every step logged and checkpointing off (unless the overrides
set ``--checkpoint.enable``); a progress line per run shows its step and time left. Arguments after
``--`` are config overrides passed to every run. With ``--seeds N`` (N > 1) every config trains once per
``training.seed`` 0..N-1 (the seed draws the initial weights and the batch order) into
``<dump-root>/<config>/seed-<s>``. ``--parallel P`` trains up to P runs at once (a debug model uses a
sliver of a GPU or a few CPU cores). With ``--runs`` the TensorBoard scalars of finished runs are read
(``<run>/tb`` or the TensorBoard folder itself; a run folder holding ``seed-<s>`` folders is one config
over those seeds). The first config / run is the baseline.

Writes a PNG with the raw loss curves under their moving average (``--smooth``) and the gap to the
baseline (``--out``) and a markdown table (``--table``). Gap statistics average the raw losses over the
last ``--last`` steps that all runs logged. One seed: the mean |gap| per config against ``--tolerance``;
exit 0 when every mean |gap| is within it, 1 when one exceeds it. Several seeds: per config its mean gap
± standard error against the baseline's seed-to-seed spread (seed_noise.py); exit 0 when every config
is within noise, 1 when one is beyond it. Exit 2 when a run fails or the input is unusable.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import os
import sys
import threading
from dataclasses import dataclass
from pathlib import Path

from torchtitan_lite.tools import fp8_verdict, seed_noise
from torchtitan_lite.tools.loss_compare_runs import CompareError, check_passthrough, read_losses, run_config
from torchtitan_lite.tools.loss_smoothing import ema, ema_curve
from torchtitan_lite.tools.seed_noise import SeedCurves, SeedVerdict

LOSS_TAG = "train/loss"
SEED_PREFIX = "seed-"
"""Run folders of one config over several seeds: <config>/seed-<s>."""
EXIT_OK, EXIT_GAP, EXIT_ERROR = 0, 1, 2


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


def seed_folders(run: Path) -> dict[str, Path]:
    """seed -> folder for a run folder holding ``seed-<s>`` folders; empty for a single run."""
    if not run.is_dir():
        return {}
    found = [p for p in run.iterdir() if p.is_dir() and p.name.startswith(SEED_PREFIX)]
    return {p.name.removeprefix(SEED_PREFIX): p for p in sorted(found, key=lambda p: _seed_order(p.name))}


def _seed_order(name: str) -> tuple[int, str]:
    seed = name.removeprefix(SEED_PREFIX)
    return (int(seed), "") if seed.isdigit() else (sys.maxsize, seed)


def read_run(run: Path, tag: str = LOSS_TAG) -> SeedCurves:
    """seed -> losses of every ``seed-<s>`` folder of ``run``, or ``{"": losses}`` for a single run."""
    folders = seed_folders(run)
    if not folders:
        return {"": read_losses(run, tag)}
    return {seed: read_losses(folder, tag) for seed, folder in folders.items()}


# --------------------------------------------------------------------------------------------------
# Gap arithmetic (one seed per config; several seeds: seed_noise.py)


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


def seed_mean_curve(seeds: SeedCurves) -> dict[int, float]:
    """step -> mean loss over the seeds, at the steps every seed logged."""
    steps = sorted(set.intersection(*(set(curve) for curve in seeds.values())))
    return {s: sum(curve[s] for curve in seeds.values()) / len(seeds) for s in steps}


# --------------------------------------------------------------------------------------------------
# Outputs


def write_table(curves: dict[str, dict[int, float]], summaries: list[GapSummary], path: Path, *,
                tolerance: float) -> None:
    """Markdown: a summary table, then one row per common step with every loss and its gap to the baseline."""
    labels = list(curves)
    window = summaries[0].steps
    lines = [f"# Loss gap vs {labels[0]}", "",
             f"Mean over the last {len(window)} common steps ({window[0]}..{window[-1]}) of the raw losses; "
             f"tolerance {tolerance:g} on mean |gap|.", "",
             "| config | mean \\|gap\\| | mean gap | final gap | within tolerance |", "|---|---:|---:|---:|---|"]
    for s in summaries:
        ok = "yes" if s.mean_abs_gap <= tolerance else "**no**"
        lines.append(f"| {s.label} | {s.mean_abs_gap:.4f} | {s.mean_gap:+.4f} | {s.final_gap:+.4f} | {ok} |")
    _write_step_rows(lines, curves, path)


def write_seed_table(runs: dict[str, SeedCurves], window: list[int], verdicts: list[SeedVerdict], path: Path) -> None:
    """Markdown: each config's verdict against the baseline's seed spread, the per-seed window means, then
    one row per common step with each config's loss averaged over its seeds."""
    labels = list(runs)
    base = runs[labels[0]]
    band = verdicts[0].band
    lines = [f"# Loss gap vs {labels[0]} over seeds", "",
             f"Window: the raw losses of the last {len(window)} common steps ({window[0]}..{window[-1]}), averaged "
             f"per run. Noise band: the standard deviation of {labels[0]}'s window mean over its {len(base)} seeds, "
             f"{band:.4f}. A config is beyond noise when |mean gap| - standard error > band.", "",
             "| config | seeds | mean gap ± std. error | gap per seed | verdict |", "|---|---|---:|---|---|"]
    for v in verdicts:
        per_seed = ", ".join(f"{g:+.4f}" for g in v.seed_gaps.values())
        verdict = f"**{v.verdict}**" if v.beyond_noise else v.verdict
        lines.append(f"| {v.label} | {', '.join(v.seeds)} | {v.mean_gap:+.4f} ± {v.std_error:.4f} | {per_seed} | "
                     f"{verdict} |")
    lines += ["", "| config | " + " | ".join(f"window mean seed {s}" for s in base) + " |",
              "|---|" + "---:|" * len(base)]
    for label, seeds in runs.items():
        means = [f"{seed_noise.window_mean(seeds[s], window):.4f}" if s in seeds else "-" for s in base]
        lines.append(f"| {label} | " + " | ".join(means) + " |")
    _write_step_rows(lines, {label: seed_mean_curve(seeds) for label, seeds in runs.items()}, path)


def _write_step_rows(lines: list[str], curves: dict[str, dict[int, float]], path: Path) -> None:
    labels = list(curves)
    header = ["step", labels[0]]
    for label in labels[1:]:
        header += [label, f"gap {label}"]
    lines += ["", "| " + " | ".join(header) + " |", "|" + "---:|" * len(header)]
    base = curves[labels[0]]
    for step in common_steps(curves):
        row = [str(step), f"{base[step]:.4f}"]
        for label in labels[1:]:
            row += [f"{curves[label][step]:.4f}", f"{curves[label][step] - base[step]:+.4f}"]
        lines.append("| " + " | ".join(row) + " |")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")


def write_plot(runs: dict[str, SeedCurves], path: Path, *, window: list[int], smooth: float,
               band: float | None = None, tag: str = LOSS_TAG) -> None:
    """Top: each config's raw loss (thin; the mean over its seeds) under its moving average (bold), with the
    range of its seeds' averages shaded; bottom: the raw and averaged gap to the baseline, the statistics
    window shaded and, over seeds, the baseline's seed band around zero."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = list(runs)
    means = {label: seed_mean_curve(seeds) for label, seeds in runs.items()}
    base = means[labels[0]]
    fig, (ax_loss, ax_gap) = plt.subplots(2, 1, figsize=(9, 7), sharex=True, gridspec_kw={"height_ratios": [2, 1]})
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, (label, seeds) in enumerate(runs.items()):
        color = colors[i % len(colors)]
        xs = sorted(means[label])
        ax_loss.plot(xs, [means[label][s] for s in xs], color=color, linewidth=0.6, alpha=0.35)
        ax_loss.plot(xs, ema([means[label][s] for s in xs], smooth), color=color, linewidth=1.8,
                     label=f"{label} ({len(seeds)} seeds)" if len(seeds) > 1 else label)
        if len(seeds) > 1:
            smoothed = [ema_curve({s: curve[s] for s in xs}, smooth) for curve in seeds.values()]
            ax_loss.fill_between(xs, [min(c[s] for c in smoothed) for s in xs], [max(c[s] for c in smoothed) for s in xs],
                                 color=color, alpha=0.15, linewidth=0)
    ax_loss.set_ylabel(f"{tag} (thin: raw, bold: EMA {smooth:g})")
    ax_loss.legend(fontsize="small")
    ax_loss.grid(alpha=0.3)
    steps = common_steps(means)
    for i, label in enumerate(labels[1:], start=1):
        color = colors[i % len(colors)]
        gaps = [means[label][s] - base[s] for s in steps]
        ax_gap.plot(steps, gaps, color=color, linewidth=0.6, alpha=0.35)
        ax_gap.plot(steps, ema(gaps, smooth), color=color, linewidth=1.6, label=f"{label} - {labels[0]}")
    ax_gap.axhline(0.0, color="black", linewidth=0.6)
    if band is not None:
        ax_gap.axhspan(-band, band, color="tab:green", alpha=0.12, label=f"±{labels[0]} seed spread ({band:.3f})")
    ax_gap.axvspan(window[0], window[-1], color="grey", alpha=0.15, label=f"last {len(window)} steps")
    ax_gap.set_xlabel("step")
    ax_gap.set_ylabel("loss gap")
    ax_gap.legend(fontsize="small", framealpha=0.6)
    ax_gap.grid(alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


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
                        help="finished runs (dump folders with tb/, TensorBoard folders, or folders of seed-<s> runs); "
                             "the first is the baseline")
    parser.add_argument("--steps", type=int, default=None, help="training steps per config (default: each config's own)")
    parser.add_argument("--seeds", type=int, default=1,
                        help="train each config with training.seed 0..N-1 and judge each gap against the baseline's "
                             "seed-to-seed spread (default 1: the config's own seed, judged against --tolerance)")
    parser.add_argument("--tag", default=LOSS_TAG,
                        help="TensorBoard scalar to compare (e.g. val/loss, logged at validation steps only)")
    parser.add_argument("--last", type=int, default=20, help="number of final common steps the gap is averaged over")
    parser.add_argument("--tolerance", type=float, default=0.05,
                        help="largest acceptable mean |loss gap| (nats) with one seed")
    parser.add_argument("--smooth", type=float, default=0.9,
                        help="EMA factor of the plotted moving average, in [0, 1) (0.9: ~10 steps); plot only")
    parser.add_argument("--out", type=Path, default=Path("loss_compare.png"), help="PNG plot to write")
    parser.add_argument("--table", type=Path, default=None,
                        help="markdown table to write (default: beside --out, with .md for .png)")
    parser.add_argument("--dump-root", type=Path, default=Path("outputs/loss_compare"),
                        help="runs go to <dump-root>/<config> (with --configs; <config>/seed-<s> with --seeds)")
    parser.add_argument("--nproc", type=int, default=1, help="processes per run; > 1 launches run_train.sh (torchrun)")
    parser.add_argument("--parallel", type=int, default=1, metavar="P",
                        help="train up to P runs at once, each with cores / P CPU threads (default 1: one after another)")
    parser.add_argument("--progress-every", type=float, default=30.0, metavar="SECONDS",
                        help="at most one progress line per run this often (besides its first and last step)")
    args = parser.parse_args(argv)
    names = args.configs or [str(r) for r in args.runs]
    if len(names) < 2:
        parser.error("give at least two configs or runs to compare")
    if len(set(names)) != len(names):
        parser.error(f"each config / run may appear once, got {names}")
    if args.runs and overrides:
        parser.error("overrides after '--' apply to --configs runs only")
    if args.runs and args.seeds != 1:
        parser.error("--seeds trains configs; with --runs give folders that hold seed-<s> runs instead")
    if args.steps is not None and args.steps < 1:
        parser.error(f"--steps must be >= 1, got {args.steps}")
    if args.seeds < 1:
        parser.error(f"--seeds must be >= 1, got {args.seeds}")
    if args.last < 1:
        parser.error(f"--last must be >= 1, got {args.last}")
    if not args.tolerance >= 0:
        parser.error(f"--tolerance must be >= 0, got {args.tolerance}")
    if not 0.0 <= args.smooth < 1.0:
        parser.error(f"--smooth must be in [0, 1), got {args.smooth}")
    if args.nproc < 1:
        parser.error(f"--nproc must be >= 1, got {args.nproc}")
    if args.parallel < 1:
        parser.error(f"--parallel must be >= 1, got {args.parallel}")
    if args.parallel > 1 and args.nproc > 1:
        parser.error("--parallel > 1 with --nproc > 1 would start several multi-process runs on the same devices; "
                     "use one or the other")
    if args.runs and args.parallel != 1:
        parser.error("--parallel trains configs; --runs reads finished runs")
    if not args.progress_every >= 0:
        parser.error(f"--progress-every must be >= 0, got {args.progress_every}")
    if args.table is None:
        args.table = args.out.with_suffix(".md")
    return args, overrides


def collect_runs(args: argparse.Namespace, overrides: list[str]) -> dict[str, SeedCurves]:
    """label -> seed -> step -> loss of every run: read from ``--runs``, or trained from ``--configs`` first
    (seed by seed, so that a cut-off comparison leaves whole seeds)."""
    if args.runs:
        return {str(run): read_run(run, args.tag) for run in args.runs}
    check_passthrough(overrides, steps=args.steps, seeds=args.seeds)
    seeds: list[int | None] = list(range(args.seeds)) if args.seeds > 1 else [None]
    jobs = [(config, seed) for seed in seeds for config in args.configs]
    # Side by side, each run gets its share of the cores instead of all of them (oversubscribed threads
    # slow every run down); one at a time, the environment decides.
    threads = max(1, (os.cpu_count() or 1) // args.parallel) if args.parallel > 1 else None

    failed = threading.Event()

    def train(number: int, config: str, seed: int | None) -> Path | None:
        if failed.is_set():
            return None   # after a failure no further run starts; those already running finish
        dump = args.dump_root / config if seed is None else args.dump_root / config / f"{SEED_PREFIX}{seed}"
        label = f"run {number}/{len(jobs)} {config}" + ("" if seed is None else f" seed {seed}")
        try:
            run_config(config, dump, steps=args.steps, overrides=overrides, nproc=args.nproc, seed=seed, label=label,
                       progress_every=args.progress_every, cpu_threads=threads)
        except BaseException:
            failed.set()
            raise
        return dump

    with concurrent.futures.ThreadPoolExecutor(max_workers=args.parallel) as pool:
        futures = [pool.submit(train, number, config, seed) for number, (config, seed) in enumerate(jobs, start=1)]
    failures = [error for future in futures if (error := future.exception()) is not None]
    if failures:
        raise failures[0]
    runs: dict[str, SeedCurves] = {config: {} for config in args.configs}
    for (config, seed), future in zip(jobs, futures):
        dump = future.result()
        assert dump is not None   # no run failed, so every run trained
        runs[config]["" if seed is None else str(seed)] = read_losses(dump, args.tag)
    return runs


def main(argv: list[str]) -> int:
    """Compare the curves ``argv`` names; exit status 0 (within tolerance / noise), 1 (a gap exceeds it) or 2
    (error)."""
    if "--verdict" in (argv[:argv.index("--")] if "--" in argv else argv):
        return fp8_verdict.main(argv)
    args, overrides = parse_args(argv)
    try:
        runs = collect_runs(args, overrides)
        if any(len(seeds) > 1 for seeds in runs.values()):
            return report_seeds(runs, args)
        return report_single(runs, args)
    except CompareError as err:
        print(f"error: {err}", file=sys.stderr)
        return EXIT_ERROR


def report_single(runs: dict[str, SeedCurves], args: argparse.Namespace) -> int:
    """One run per config: mean |gap| over the window against --tolerance."""
    curves = {label: next(iter(seeds.values())) for label, seeds in runs.items()}
    summaries = summarize_gaps(curves, args.last)
    window = summaries[0].steps
    write_plot(runs, args.out, window=window, smooth=args.smooth, tag=args.tag)
    write_table(curves, summaries, args.table, tolerance=args.tolerance)
    baseline = next(iter(curves))
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


def report_seeds(runs: dict[str, SeedCurves], args: argparse.Namespace) -> int:
    """Several seeds: each config's mean gap ± standard error against the baseline's seed-to-seed spread."""
    try:
        window, verdicts = seed_noise.judge(runs, args.last)
    except ValueError as err:
        raise CompareError(str(err)) from None
    band = verdicts[0].band
    write_plot(runs, args.out, window=window, smooth=args.smooth, band=band, tag=args.tag)
    write_seed_table(runs, window, verdicts, args.table)
    baseline = next(iter(runs))
    print(f"baseline {baseline} over {len(runs[baseline])} seeds; window: the last {len(window)} common steps "
          f"({window[0]}..{window[-1]}); noise band (its seed-to-seed std. dev.) {band:.4f}:")
    for v in verdicts:
        per_seed = ", ".join(f"{seed} {gap:+.4f}" for seed, gap in v.seed_gaps.items())
        print(f"  {v.label}: mean gap {v.mean_gap:+.4f} ± {v.std_error:.4f} (seeds {per_seed}) -> {v.verdict}")
    print(f"plot: {args.out}; table: {args.table}")
    beyond = [v.label for v in verdicts if v.beyond_noise]
    if beyond:
        print(f"error: loss gap to {baseline} beyond its seed-to-seed noise for: {', '.join(beyond)}", file=sys.stderr)
        return EXIT_GAP
    return EXIT_OK
