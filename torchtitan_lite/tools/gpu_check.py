"""GPU acceptance run that fits the device time it gets: stages by priority within ``--budget`` seconds,
each stage's figure written the moment it ends.

    scripts/gpu_check.sh --plan                        # expected time per stage, what fits (no GPU needed)
    scripts/gpu_check.sh --budget 540 --wheels gpu_wheels --out /tmp/gc
    scripts/gpu_check.sh --stages a --out /tmp/gc      # one stage, merged into an earlier run's report

Stages run in priority order (``PRIORITY``), each in its own process. Before a stage starts, its expected
time (``EXPECTED_S``, from recorded runs) must fit in what is left of the budget, otherwise it is *cut*:
not started, and the report says so with the time it needed. A started stage may run to its limit or to the
end of the budget, whichever comes first; one stopped there is reported as cut mid-way with what it wrote.
After every stage, summary.json and BENCHMARKS_section.md are rewritten, so a run stopped from outside keeps
every finished stage's figure (SIGTERM stops the running stage and writes the report first).

b. ``scripts/float8_layer_bench.py --shapes llama3_8b``: each Linear shape of an 8B block and the head, BF16
   vs tensorwise, rowwise and rowwise_with_gw_hp (and MXFP8 on sm_100), compiled, at 8192 tokens; the
   blockwise Linear only when the budget leaves room for torchao's Triton autotuning (~100 s per shape).
c. ``scripts/benchmark.py`` on a representative proxy: the 8B width with enough blocks that the BF16 output
   head is at most 10% of the FLOPs (``proxy_model.py``: 17 at seq 8192), selective activation checkpointing,
   compiled, >= 30 timed steps, BF16 / FP8 tensorwise / FP8 rowwise, each profiled for a few more steps;
   then ``fp8_expectation.py`` puts the expected speedup (layer bench x the BF16 step's GEMM time per shape)
   beside the measured one, with a per-category profile where measured < 0.9 x expected.
e. ``scripts/benchmark.py`` on the MoE family: Qwen3-30B-A3B's width (128 experts, top-8) cut to 2 blocks,
   seq 4096 x 4 sequences = 1,024 tokens per expert, compiled: BF16 grouped experts vs FP8 rowwise experts.
a. ``pytest -m gpu tests/gpu``: the tests that exist only for CUDA.
d. ``scripts/loss_compare.py --seeds 3``: llama3_debug_bf16 vs llama3_debug_fp8 over three seeds.
h. The 8B width cut to 4 blocks (head 31% of the FLOPs), compiled: kept as a labelled extra for comparison
   with earlier runs.
i. ``scripts/benchmark.py`` on stage c's proxy: llama3_8b_fp8 against llama3_8b_fp8_head (the output head in
   FP8 tensorwise too), one round, unprofiled: what the FP8 head gains on the step. An extra, after c's
   three configs, because a fourth config in c would push e out of the default budget.
f, g. Pipeline parallelism on 2 GPUs (skipped, with the reason, on a machine with fewer).

With ``--wheels DIR`` the wheels in DIR (scripts/fetch_gpu_wheels.sh) are installed first, offline. Targets
are reported, not enforced: a stage fails when its command fails, not when a speed target is missed.
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from dataclasses import asdict, dataclass, field
from pathlib import Path

from torchtitan_lite.tools.gpu_check_stages import (
    PRIORITY,
    STAGE_KEYS,
    Stage,
    build_stages,
    choose_run_shape,
    plan,
    size_proxy,
)

REPO = Path(__file__).resolve().parents[2]
BUDGET_S = 9 * 60
"""Default --budget: one device command's share of a 10-minute limit (the rest: wheels, probing, copying)."""
LIMIT_FACTOR = 1.6
"""A started stage may run this many times its expected time (the budget's end permitting)."""
REQUIRED_MODULES = ("torch", "torchao", "datasets", "sentencepiece", "tensorboard", "safetensors", "pytest",
                    "matplotlib", "numpy")


@dataclass
class StageResult:
    key: str
    title: str
    command: str
    passed: bool
    figure: str
    seconds: float
    exit_code: int | None
    log: str
    details: dict = field(default_factory=dict)
    skipped: bool = False
    """Not run: too few GPUs, or cut by the budget (the figure says which). Does not fail the run."""


# --------------------------------------------------------------------------------------------------
# The stages


def skip_reason(stage: Stage, gpus: int) -> str | None:
    """Why ``stage`` cannot run on a machine with ``gpus`` GPUs, or None when it can."""
    if stage.gpus <= gpus:
        return None
    return (f"skipped: needs {stage.gpus} GPUs (one per pipeline rank), this machine has {gpus}; "
            f"run it on a machine with {stage.gpus} or more")


def merge_results(out: Path, results: list[StageResult]) -> list[StageResult]:
    """This call's results plus those of stages an earlier call wrote into the same folder (by stage)."""
    merged = {}
    summary = out / "summary.json"
    if summary.exists():
        for earlier in json.loads(summary.read_text())["stages"]:
            merged[earlier["key"]] = StageResult(**earlier)
    merged.update((r.key, r) for r in results)
    return [merged[key] for key in sorted(merged)]


def wheel_install_command(python: str, wheels: Path) -> list[str]:
    return [python, "-m", "pip", "install", "--no-index", "--no-deps", "--disable-pip-version-check",
            *sorted(str(p) for p in wheels.rglob("*.whl"))]


# --------------------------------------------------------------------------------------------------
# Running


def skip_stage(stage: Stage, reason: str) -> StageResult:
    print(f"[{stage.key}] {stage.title}\n[{stage.key}] SKIPPED: {reason.removeprefix('skipped: ')}", flush=True)
    return StageResult(stage.key, stage.title, shlex.join(stage.command), True, reason, 0.0, None, "", skipped=True)


def cut_stage(stage: Stage, left_s: float) -> StageResult:
    """A stage the budget has no room for: not started, reported as cut (not a failure)."""
    reason = (f"cut: not started, it needs ~{stage.expected_s} s and {max(0, int(left_s))} s of --budget were "
              f"left; run it alone with --stages {stage.key} --out <this folder>")
    print(f"[{stage.key}] {stage.title}\n[{stage.key}] CUT: {reason.removeprefix('cut: ')}", flush=True)
    return StageResult(stage.key, stage.title, shlex.join(stage.command), True, reason, 0.0, None, "", skipped=True)


class Stopped(Exception):
    """SIGTERM reached gpu_check while a stage ran: the stage is stopped and the report written."""


def run_stage(stage: Stage, out: Path, env: dict[str, str], timeout_s: float) -> StageResult:
    """Run ``stage`` for at most ``timeout_s`` seconds (its whole process group is stopped then, or on SIGTERM)."""
    log_path = out / f"{stage.key}_{stage.name}.log"
    print(f"[{stage.key}] {stage.title} (expected ~{stage.expected_s} s, stopped after {timeout_s:.0f} s)\n"
          f"    $ {shlex.join(stage.command)}", flush=True)
    start = time.perf_counter()
    exit_code: int | None
    stopped = False
    with open(log_path, "w") as log:
        proc = subprocess.Popen(stage.command, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)
        try:
            exit_code = proc.wait(timeout=timeout_s)
        except (subprocess.TimeoutExpired, Stopped) as err:
            stopped = isinstance(err, Stopped)
            _stop_group(proc)
            exit_code = None
    seconds = time.perf_counter() - start
    text = log_path.read_text(errors="replace")
    try:
        sound, figure = stage.figure(out, text)
    except (OSError, ValueError, KeyError, ET.ParseError) as err:
        sound, figure = False, f"could not read the stage's results: {err}"
    if exit_code is None:
        why = "the run was stopped (SIGTERM)" if stopped else f"its {timeout_s:.0f} s ran out"
        sound, figure = False, f"cut mid-way after {seconds:.0f} s: {why}; what it wrote: {figure}"
    elif exit_code != 0:
        sound, figure = False, f"exit {exit_code}; {figure}"
    result = StageResult(stage.key, stage.title, shlex.join(stage.command), sound, figure, seconds, exit_code,
                         str(log_path.relative_to(out)))
    print(f"[{stage.key}] {'PASS' if sound else 'FAIL'} in {seconds:.0f} s: {figure}", flush=True)
    if not sound:
        print("    last lines of the log:\n" + "".join(f"    {line}\n" for line in text.splitlines()[-15:]), flush=True)
    if stopped:
        raise Stopped(result)
    return result


def _stop_group(proc: subprocess.Popen) -> None:
    """SIGTERM to the stage's whole process group (torchrun, compile workers), SIGKILL after 10 s."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    except ProcessLookupError:
        pass


def _raise_stopped(signum: int, frame: object) -> None:
    raise Stopped()


def probe_interpreter(python: str) -> tuple[list[str], dict[str, str]]:
    """Modules the stages need that ``python`` cannot import (each with its error: a version clash shows
    here), and the device, driver and library versions, asked of that interpreter in one process."""
    probe = ("import importlib, json\n"
             "bad = []\n"
             f"for name in {REQUIRED_MODULES!r}:\n"
             "    try:\n"
             "        importlib.import_module(name)\n"
             "    except Exception as err:\n"
             "        bad.append(f'{name} ({type(err).__name__}: {err})')\n"
             "info = {}\n"
             "if not bad:\n"
             "    import torch, torchao\n"
             "    n = torch.cuda.device_count()\n"
             "    info = {'device': torch.cuda.get_device_name(0) if n else 'no CUDA device', 'gpus': str(n),\n"
             "            'torch': torch.__version__, 'cuda': str(torch.version.cuda), 'torchao': torchao.__version__}\n"
             "    if n:\n"
             "        total = torch.cuda.get_device_properties(0).total_memory\n"
             "        info.update(memory_bytes=str(total), memory_gib=f'{total / 1024**3:.0f}')\n"
             "print(json.dumps([bad, info]))")
    result = subprocess.run([python, "-c", probe], capture_output=True, text=True, cwd="/")
    if result.returncode != 0:
        return [f"(the interpreter {python} does not run: {result.stderr.strip()[-300:]})"], {}
    missing, info = json.loads(result.stdout.strip().splitlines()[-1])
    info["driver"] = _command_output(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"]) or "unknown"
    info["commit"] = _command_output(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"]) or "unknown"
    if _command_output(["git", "-C", str(REPO), "status", "--porcelain", "--untracked-files=no"]):
        info["commit"] += " (with uncommitted changes)"
    info["date"] = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    info["python"] = python
    return missing, info


def _interpreter(name: str) -> str:
    """Absolute path of the interpreter (the stages run from the repository, probes from /)."""
    found = shutil.which(name) if os.sep not in name else (name if os.path.exists(name) else None)
    if found is None:
        raise SystemExit(f"error: TTL_PYTHON={name} is not an interpreter on this machine; set it to the python "
                         f"that has torch with CUDA")
    return os.path.abspath(found)


def _command_output(cmd: list[str]) -> str:
    try:
        result = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return result.stdout.strip().splitlines()[0] if result.returncode == 0 and result.stdout.strip() else ""


# --------------------------------------------------------------------------------------------------
# Report


def markdown_section(results: list[StageResult], info: dict[str, str], command: str, out: Path,
                     notes: list[str] = ()) -> str:  # type: ignore[assignment]
    lines = [f"## GPU acceptance run on {info['gpus']} x {info['device']} ({info['date']})", "",
             f"- device: {info['gpus']} x {info['device']} ({info.get('memory_gib', '?')} GiB), driver "
             f"{info['driver']}, CUDA {info['cuda']}",
             f"- torch {info['torch']}, torchao {info['torchao']}; commit {info['commit']}; {info['date']}",
             f"- command: `{command}`", *(f"- {note}" for note in notes), "",
             "| stage | result | figure | seconds |", "|---|---|---|---:|"]
    for r in results:
        figure = r.figure.replace("|", "\\|")
        verdict = ("cut" if r.figure.startswith("cut:") else "skipped") if r.skipped else \
            "pass" if r.passed else "**FAIL**"
        lines.append(f"| {r.key}. {r.title} | {verdict} | {figure} | {r.seconds:.0f} |")
    layers = out / "b_layers.json"
    if layers.exists():
        lines += ["", "### float8 Linear forward+backward (stage b)", "", layer_table(json.loads(layers.read_text()))]
    for name, heading in (("c_benchmark.md", None), ("c_expected.md", "Expected against measured (stage c)"),
                          ("e_benchmark.md", None), ("e_profiles.md", "Where the MoE step's time goes (stage e)"),
                          ("d_loss_compare.md", "Loss comparison (stage d)"),
                          ("h_benchmark.md", None), ("i_benchmark.md", None)):
        path = out / name
        if path.exists():
            lines += ["", f"### {heading}" if heading else "", path.read_text().strip()]
    return "\n".join(lines) + "\n"


def layer_table(data: dict) -> str:
    """The layer bench's JSON as a table: milliseconds per variant and speedup over BF16 per shape."""
    rows = data["rows"]
    recipes = list(dict.fromkeys(k for r in rows for k in r["seconds"] if k != "hp"))
    lines = ["| layer | M | K | N | x | bf16 ms | " + " | ".join(f"{r} ms (speedup)" for r in recipes) + " |",
             "|---|---:|---:|---:|---:|---:|" + "---:|" * len(recipes)]
    for r in rows:
        hp = r["seconds"]["hp"]
        cells = [f"{r['seconds'][k] * 1e3:.3f} ({hp / r['seconds'][k]:.2f}x)" if k in r["seconds"] else "-"
                 for k in recipes]
        lines.append(f"| {r['name']} | {r['m']} | {r['k']} | {r['n']} | {r['count']} | {hp * 1e3:.3f} | "
                     + " | ".join(cells) + " |")
    return "\n".join(lines)


def write_report(out: Path, results: list[StageResult], info: dict[str, str], command: str,
                 notes: list[str]) -> None:
    """summary.json and BENCHMARKS_section.md as they stand (rewritten after every stage)."""
    merged = merge_results(out, results)
    (out / "BENCHMARKS_section.md").write_text(markdown_section(merged, info, command, out, notes))
    (out / "summary.json").write_text(json.dumps({"environment": info, "command": command, "notes": notes,
                                                  "stages": [asdict(r) for r in merged]}, indent=2) + "\n")


# --------------------------------------------------------------------------------------------------


def default_out() -> Path:
    commit = _command_output(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"]) or "nocommit"
    return REPO / "gpu_check" / f"{dt.datetime.now(dt.timezone.utc):%Y%m%d-%H%M}-{commit}"


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="scripts/gpu_check.sh", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog=__doc__.split("\n\n", 1)[1])
    parser.add_argument("--plan", action="store_true",
                        help="print each stage's expected time and command, and what the budget fits; exit 0 "
                             "(no GPU needed)")
    parser.add_argument("--budget", type=int, default=BUDGET_S, metavar="SECONDS",
                        help=f"seconds the stages may take together (default {BUDGET_S}: one 10-minute device "
                             "command); stages that do not fit are cut and reported")
    parser.add_argument("--out", type=Path, default=None, help="output folder (default gpu_check/<date>-<commit>)")
    parser.add_argument("--wheels", type=Path, default=None,
                        help="install the wheels in this folder first (pip --no-index --no-deps; "
                             "scripts/fetch_gpu_wheels.sh makes it)")
    parser.add_argument("--stages", default=STAGE_KEYS,
                        help=f"which stages may run, e.g. 'bce' (default: {STAGE_KEYS}); they run in the order "
                             f"{PRIORITY}")
    args = parser.parse_args(argv)
    unknown = set(args.stages) - set(STAGE_KEYS)
    if unknown or not args.stages:
        parser.error(f"--stages takes letters from '{STAGE_KEYS}', got {args.stages!r}")
    if args.budget < 60:
        parser.error(f"--budget {args.budget}: give at least 60 seconds")
    if args.wheels is not None and not any(args.wheels.rglob("*.whl")):
        parser.error(f"--wheels {args.wheels}: no .whl files there; make the folder with scripts/fetch_gpu_wheels.sh DIR")
    return args


def print_plan(planned: list[tuple[Stage, bool]], budget_s: int, out: Path, python: str,
               setup: list[str] | None) -> None:
    used = sum(s.expected_s for s, fits in planned if fits and s.gpus == 1)
    cut = [s.key for s, fits in planned if not fits]
    print(f"# gpu_check plan: run from {REPO} with PYTHONPATH={REPO}; output under {out}; interpreter {python}; "
          f"--budget {budget_s} s: the stages that fit expect {used} s together"
          + (f"; cut for the budget: {', '.join(cut)}" if cut else ""))
    if setup:
        print(f"# setup: install the carried wheels\n{shlex.join(setup)}")
    clock = 0
    for stage, fits in planned:
        if stage.gpus > 1:
            when = f"needs {stage.gpus} GPUs, skipped on a machine with fewer; ~{stage.expected_s} s where it runs"
        elif fits:
            clock += stage.expected_s
            when = f"expected ~{stage.expected_s} s, done by ~{clock} s"
        else:
            when = f"CUT: expected ~{stage.expected_s} s, does not fit in what the stages before it leave"
        note = f"; {stage.note}" if stage.note else ""
        print(f"# stage {stage.key}: {stage.title} ({when}{note})\n{shlex.join(stage.command)}")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    python = _interpreter(os.environ.get("TTL_PYTHON") or sys.executable)
    out = (args.out or default_out()).resolve()
    shape = choose_run_shape(args.budget, args.stages)
    planned = plan(build_stages(python, out, shape), args.stages, args.budget)
    setup = wheel_install_command(python, args.wheels) if args.wheels else None
    if args.plan:
        print_plan(planned, args.budget, out, python, setup)
        return 0

    if setup:
        print(f"[setup] $ {shlex.join(setup)}", flush=True)
        installed = subprocess.run(setup, capture_output=True, text=True)
        out.mkdir(parents=True, exist_ok=True)
        (out / "setup_wheels.log").write_text(installed.stdout + installed.stderr)
        if installed.returncode != 0:
            print(f"error: installing the wheels failed (exit {installed.returncode}):\n{installed.stderr[-2000:]}",
                  file=sys.stderr)
            return 2
    missing, info = probe_interpreter(python)
    if missing:
        print(f"error: {python} cannot import {'; '.join(missing)}. Set TTL_PYTHON to an interpreter that has them, "
              f"or carry wheels made with scripts/fetch_gpu_wheels.sh DIR and pass --wheels DIR", file=sys.stderr)
        return 2
    if info["gpus"] == "0":
        print(f"error: {python} sees no CUDA device (torch {info['torch']}, CUDA {info['cuda']}); this check needs "
              f"one or more GPUs. Use --plan to see what it would run", file=sys.stderr)
        return 2
    deadline = time.perf_counter() + args.budget
    out.mkdir(parents=True, exist_ok=True)  # only now: a refused check leaves no output folder behind
    print(f"gpu_check: {info['gpus']} x {info['device']}, driver {info['driver']}, torch {info['torch']}, "
          f"torchao {info['torchao']}, commit {info['commit']}; --budget {args.budget} s; output in {out}", flush=True)
    command = shlex.join(["scripts/gpu_check.sh", *argv])
    notes = [f"stage {s.key}: {s.note}" for s, _ in planned if s.note]
    planned, fit_note = size_proxy(planned, shape, python, out, info)
    notes += [fit_note] if fit_note else []

    env = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONPATH=os.pathsep.join(
        p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p))
    gpus = int(info["gpus"])
    results: list[StageResult] = []
    signal.signal(signal.SIGTERM, _raise_stopped)
    try:
        for stage, _ in planned:
            left = deadline - time.perf_counter()
            if (reason := skip_reason(stage, gpus)) is not None:
                results.append(skip_stage(stage, reason))
            elif stage.expected_s > left:
                results.append(cut_stage(stage, left))
            else:
                results.append(run_stage(stage, out, env, min(stage.expected_s * LIMIT_FACTOR, left)))
            write_report(out, results, info, command, notes)
    except Stopped as stop:
        if stop.args:
            results.append(stop.args[0])
        notes.append("the run was stopped from outside (SIGTERM); the stages after the last one listed did not run")
        write_report(out, results, info, command, notes)
        print(f"gpu_check: stopped; the report so far is in {out / 'BENCHMARKS_section.md'}", flush=True)
        return 1

    merged = merge_results(out, results)
    failed = [r.key for r in merged if not r.passed]
    skipped = [r.key for r in merged if r.skipped]
    ran = len(merged) - len(skipped)
    print(f"\ngpu_check: {ran - len(failed)} of {ran} stages passed"
          f"{'; failed: ' + ', '.join(failed) if failed else ''}"
          f"{'; not run (cut by the budget or too few GPUs): ' + ', '.join(skipped) if skipped else ''}. "
          f"Markdown for BENCHMARKS.md: {out / 'BENCHMARKS_section.md'}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
