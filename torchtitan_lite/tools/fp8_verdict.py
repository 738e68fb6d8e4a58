"""The FP8 verdict of a model family: each recipe's validation loss against BF16's, paired by seed, with a
control that must PASS and a planted fault that must FAIL (paired_verdict.py has the statistics).

    python scripts/loss_compare.py --verdict llama3 --seeds 4 --parallel 2
    python scripts/loss_compare.py --verdict llama3 --recipes tensorwise rowwise --seeds 4
    python scripts/loss_compare.py --verdict qwen3_moe --fault e5m2_forward --seeds 4

Arms (fp8_verdict_setups.py): FP32, BF16, the fault arm (a recipe with a planted fault, fault_train.py) and the
recipes, each trained once per seed 0..K-1 into ``<dump-root>/<family>/<arm>/seed-<s>``, seed by seed (a cut
run leaves whole seeds). Writes a markdown report (``--table``) and prints the verdicts. Exit 0 when every
recipe PASSes, 1 when one FAILs, 3 when the verdict is INCONCLUSIVE (a control misbehaved, or an interval
straddles δ), 2 on bad input or a failed run.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import os
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from torchtitan_lite.tools.fp8_verdict_setups import FamilySetup, setup_for
from torchtitan_lite.tools.loss_compare_runs import CompareError, check_passthrough, finished_wall_s, read_losses, run_config
from torchtitan_lite.tools.paired_verdict import CONFIDENCE, FAIL, INCONCLUSIVE, PASS, PairedVerdict, Verdicts, paired, statistic
from torchtitan_lite.tools.run_progress import format_duration

EXIT_PASS, EXIT_FAIL, EXIT_ERROR, EXIT_INCONCLUSIVE = 0, 1, 2, 3
VAL_TAG = "val/loss"
REFERENCE, BASELINE = "fp32", "bf16"


@dataclass(frozen=True)
class Arm:
    name: str
    config: str
    fault: str | None = None


def arms_of(setup: FamilySetup, recipes: list[str], fault: str) -> list[Arm]:
    """FP32, BF16, the fault arm, then the recipes."""
    fault_arm = Arm(f"fault-{fault}-{setup.fault_recipe}", setup.recipes[setup.fault_recipe], fault)
    return [Arm(REFERENCE, setup.reference), Arm(BASELINE, setup.baseline), fault_arm,
            *(Arm(recipe, setup.recipes[recipe]) for recipe in recipes)]


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    overrides: list[str] = []
    if "--" in argv:
        split = argv.index("--")
        argv, overrides = argv[:split], argv[split + 1:]
    parser = argparse.ArgumentParser(prog="loss_compare.py --verdict", description=__doc__.split("\n\n")[0])
    parser.add_argument("--verdict", required=True, metavar="FAMILY", help="model family: llama3, qwen3_moe, deepseek_v3")
    parser.add_argument("--recipes", nargs="+", default=None,
                        help="recipes to judge (default: the family's default ones, e.g. all of llama3's but "
                             "tensorwise_head)")
    parser.add_argument("--fault", default=None, help="planted fault of the fault arm (default: the family's)")
    parser.add_argument("--seeds", type=int, default=4, help="seeds 0..K-1 per arm (K >= 2; default 4)")
    parser.add_argument("--delta", type=float, default=None, help="δ in nats (default: the family's, see the report)")
    parser.add_argument("--parallel", type=int, default=1, metavar="P",
                        help="train up to P runs at once, each with cores / P CPU threads")
    parser.add_argument("--dump-root", type=Path, default=Path("outputs/fp8_verdict"),
                        help="runs go to <dump-root>/<family>/<arm>/seed-<s>")
    parser.add_argument("--table", type=Path, default=None,
                        help="markdown report (default: <dump-root>/<family>/verdict.md)")
    parser.add_argument("--reuse", action="store_true",
                        help="keep runs an earlier verdict finished with the same command (an interrupted verdict "
                             "goes on where it stopped); without it every run trains again")
    parser.add_argument("--progress-every", type=float, default=60.0, metavar="SECONDS",
                        help="at most one progress line per run this often")
    args = parser.parse_args(argv)
    try:
        setup = setup_for(args.verdict)
    except ValueError as err:
        parser.error(str(err))
    unknown = [r for r in args.recipes or [] if r not in setup.recipes]
    if unknown:
        parser.error(f"{args.verdict} has no recipe {', '.join(unknown)}; choose from {', '.join(setup.recipes)}")
    args.recipes = args.recipes or list(setup.default_recipes or setup.recipes)
    if args.seeds < 2:
        parser.error(f"--seeds must be >= 2 (a paired verdict needs a spread of gaps), got {args.seeds}")
    if args.parallel < 1:
        parser.error(f"--parallel must be >= 1, got {args.parallel}")
    if args.delta is not None and not args.delta > 0:
        parser.error(f"--delta must be > 0 nats, got {args.delta}")
    args.setup = setup
    args.fault = args.fault or setup.fault
    from torchtitan_lite.tools.fp8_faults import FAULTS

    if args.fault not in FAULTS:
        parser.error(f"unknown planted fault {args.fault!r}; choose one of: {', '.join(FAULTS)}")
    if args.table is None:
        args.table = args.dump_root / setup.family / "verdict.md"
    return args, overrides


def train_arms(args: argparse.Namespace, arms: list[Arm], overrides: list[str]) -> tuple[dict[str, dict[str, float]],
                                                                                      dict[str, list[float]]]:
    """arm -> seed -> statistic, and arm -> wall seconds of each run; seed-major, up to --parallel at once."""
    setup: FamilySetup = args.setup
    check_passthrough(overrides, steps=None, seeds=args.seeds)
    jobs = [(arm, seed) for seed in range(args.seeds) for arm in arms]
    threads = max(1, (os.cpu_count() or 1) // args.parallel) if args.parallel > 1 else None
    failed, lock = threading.Event(), threading.Lock()
    stats: dict[str, dict[str, float]] = {arm.name: {} for arm in arms}
    walls: dict[str, list[float]] = {arm.name: [] for arm in arms}
    start = time.perf_counter()
    done, trained = [0], [0]

    def say(line: str) -> None:
        with lock:  # one write per line: runs side by side would interleave print's pieces
            sys.stdout.write(line + "\n")
            sys.stdout.flush()

    def train(number: int, arm: Arm, seed: int) -> None:
        if failed.is_set():
            return
        dump = args.dump_root / setup.family / arm.name / f"seed-{seed}"
        arm_overrides = [*setup.overrides, *overrides]
        try:
            earlier = finished_wall_s(arm.config, dump, steps=None, overrides=arm_overrides, seed=seed,
                                      fault=arm.fault) if args.reuse else None
            reused = earlier is not None
            if earlier is not None:
                wall = earlier
                say(f"[verdict] run {number}/{len(jobs)} {arm.name} seed {seed}: reused {dump}")
            else:
                wall = run_config(arm.config, dump, steps=None, overrides=arm_overrides, nproc=1, seed=seed,
                                  label=f"run {number}/{len(jobs)} {arm.name} seed {seed}",
                                  progress_every=args.progress_every, cpu_threads=threads, fault=arm.fault)
            value = statistic(read_losses(dump, VAL_TAG), setup.eval_steps, str(dump))
        except BaseException:
            failed.set()
            raise
        with lock:
            stats[arm.name][str(seed)] = value
            walls[arm.name].append(wall)
            done[0] += 1
            trained[0] += 0 if reused else 1
            elapsed = time.perf_counter() - start
            # The rate of the runs trained here (reused ones take no time), over the runs still to train.
            left = elapsed / trained[0] * (len(jobs) - done[0]) if trained[0] else None
        say(f"[verdict] {done[0]}/{len(jobs)} runs done, {format_duration(elapsed)} elapsed"
            + (f", ~{format_duration(left)} left" if left is not None else ""))

    with concurrent.futures.ThreadPoolExecutor(max_workers=args.parallel) as pool:
        futures = [pool.submit(train, n, arm, seed) for n, (arm, seed) in enumerate(jobs, start=1)]
    errors = [e for f in futures if (e := f.exception()) is not None]
    if errors:
        raise errors[0] if isinstance(errors[0], CompareError) else CompareError(str(errors[0]))
    return stats, walls


def judge(args: argparse.Namespace, arms: list[Arm], stats: dict[str, dict[str, float]]) -> Verdicts:
    delta = args.delta if args.delta is not None else args.setup.delta
    base = stats[BASELINE]
    fault_arm = arms[2]
    return Verdicts(control=paired(f"{BASELINE} vs {REFERENCE}", base, stats[REFERENCE], delta),
                    fault=paired(f"{fault_arm.name} vs {BASELINE}", stats[fault_arm.name], base, delta),
                    recipes=[paired(f"{arm.name} vs {BASELINE}", stats[arm.name], base, delta) for arm in arms[3:]])


def _row(v: PairedVerdict, final: str) -> str:
    per_seed = ", ".join(f"{g:+.4f}" for g in v.gaps.values())
    return (f"| {v.label} | {v.mean:+.4f} | {v.std_error:.4f} | [{v.lower:+.4f}, {v.upper:+.4f}] | {per_seed} | "
            f"{v.outcome} | **{final}** |")


def report(args: argparse.Namespace, verdicts: Verdicts, walls: dict[str, list[float]], wall_s: float,
           command: str) -> str:
    setup: FamilySetup = args.setup
    delta = verdicts.control.delta
    lines = [f"# FP8 verdict: {setup.family}", "",
             f"Command: `{command}`", "",
             f"Seeds 0..{args.seeds - 1}; statistic: the mean validation loss at steps "
             f"{', '.join(map(str, setup.eval_steps))}; schedule `{' '.join(setup.overrides)}`. "
             f"δ = {delta:g} nats ({setup.delta_why if args.delta is None else 'given with --delta'}). "
             f"Interval: mean gap ± t({CONFIDENCE:g}, {args.seeds - 1}) x SE; PASS when its top <= δ, FAIL when "
             f"its bottom > δ. Wall time {format_duration(wall_s)} for {sum(map(len, walls.values()))} runs "
             f"(--parallel {args.parallel}).", "",
             "| comparison | mean gap | SE | one-sided 95% bounds | gap per seed | outcome | verdict |",
             "|---|---:|---:|---|---|---|---|",
             _row(verdicts.control, "control: must PASS"), _row(verdicts.fault, "control: must FAIL")]
    lines += [_row(v, verdicts.final(v)) for v in verdicts.recipes]
    if not verdicts.controls_behave:
        lines += ["", "INCONCLUSIVE: " + "; ".join(verdicts.why_inconclusive())]
    lines += ["", "| arm | mean wall time per run |", "|---|---:|"]
    lines += [f"| {arm} | {format_duration(sum(w) / len(w))} |" for arm, w in walls.items() if w]
    return "\n".join(lines) + "\n"


def exit_code(verdicts: Verdicts) -> int:
    finals = [verdicts.final(v) for v in verdicts.recipes]
    if INCONCLUSIVE in finals:
        return EXIT_INCONCLUSIVE
    return EXIT_FAIL if FAIL in finals else EXIT_PASS


def main(argv: list[str]) -> int:
    args, overrides = parse_args(argv)
    arms = arms_of(args.setup, args.recipes, args.fault)
    start = time.perf_counter()
    try:
        stats, walls = train_arms(args, arms, overrides)
        verdicts = judge(args, arms, stats)
    except (CompareError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return EXIT_ERROR
    command = "python scripts/loss_compare.py " + " ".join(argv)
    text = report(args, verdicts, walls, time.perf_counter() - start, command)
    args.table.parent.mkdir(parents=True, exist_ok=True)
    args.table.write_text(text)
    print(text)
    finals = {v.label.removesuffix(f" vs {BASELINE}"): verdicts.final(v) for v in verdicts.recipes}
    print(f"[verdict] {args.setup.family}: " + ", ".join(f"{k} {v}" for k, v in finals.items()) + f" (report: {args.table})")
    if not verdicts.controls_behave:
        print("error: INCONCLUSIVE: " + "; ".join(verdicts.why_inconclusive()), file=sys.stderr)
    return exit_code(verdicts)


__all__ = ["EXIT_ERROR", "EXIT_FAIL", "EXIT_INCONCLUSIVE", "EXIT_PASS", "PASS", "main"]
