"""GPU acceptance run: the CUDA tests, FP8 layer speed, 8B-width training throughput, an FP8 loss check and,
with 2+ GPUs, pipeline parallelism.

    scripts/gpu_check.sh                        # everything, into gpu_check/<date>-<commit>/
    scripts/gpu_check.sh --plan                 # print the commands and exit (works without a GPU)
    TTL_PYTHON=/opt/py/bin/python scripts/gpu_check.sh --wheels /data/wheels --out /data/gpu_run

Stages, in order (each in its own process with its own time limit; a failed stage does not stop the
next; the exit status is 1 if any failed). Stages a-e need one GPU; their limits come from their times on
an H200 and add up to ~18 minutes, so on a machine lent for 10-minute commands they run as two commands,
``--stages ade`` then ``--stages bc``, into one ``--out`` folder: results of stages already in that folder
are kept in the report, so the two give the same report as one run. f and g need two GPUs and add their
own limits; on a machine with fewer GPUs than a stage needs, the stage is skipped, says why, and does not
fail the run. Stages chosen with ``--stages`` whose limits leave part of 9 minutes unused share it out.

a. ``pytest -m gpu tests/gpu``: the tests that exist only for CUDA (real ``_scaled_mm`` vs emulation,
   compiled FP8, FSDP2 float8 all-gather, TP float8 styles, DCP, FP16 scaler, memory estimate, MoE grouped
   experts: bf16 against the per-expert loop, torchao's FP8 rowwise / MXFP8 grouped GEMMs against emulation;
   torchao's blockwise FP8 kernels vs the blockwise emulation on sm_90).
b. ``scripts/float8_layer_bench.py --shapes llama3_8b``: each Linear shape of an 8B block, BF16 vs each FP8
   recipe, compiled, then blockwise FP8 (DeepSeek-V3 tiles; eager: torchao's Triton quantization and
   cuBLAS's blockwise GEMM on sm_90, emulated elsewhere, which the log's header says). Blockwise's first
   call per shape autotunes torchao's Triton kernels (~100 s for one shape on an H200), hence the limit.
c. ``scripts/benchmark.py``: an 8B-width model cut to 4 layers at seq 8192, BF16, FP8 tensorwise and
   FP8 rowwise, all compiled: tokens/s, TFLOP/s, MFU, peak memory, cold compile time, speedup.
d. ``scripts/loss_compare.py --seeds 3 --parallel 6``: 200 steps of llama3_debug_bf16 vs llama3_debug_fp8
   on CUDA over three seeds, the six runs side by side: FP8's mean gap ± standard error against BF16's
   seed-to-seed spread (one seed's gap is mostly trajectory noise at this scale).
e. ``scripts/benchmark.py`` on the MoE family: Qwen3-30B-A3B's width (128 experts, top-8) cut to 2 blocks
   so that it fits one GPU, seq 4096, BF16 grouped experts vs FP8 rowwise experts (torchao's grouped
   GEMM kernels on Hopper), eager, on the embedded corpus with the byte tokenizer: tokens/s per config.
f. ``NGPU=2 ./run_train.sh --config llama3_debug --parallelism.pp 2``: 20 steps of the 1F1B pipeline on two
   GPUs (NCCL), validation included: the first and last loss.
g. ``scripts/pipeline_bubble.py --device cuda --pp 2``: each schedule's idle share of a step on two GPUs
   against its theory, at the 8B width cut to 8 blocks, float32.

With ``--wheels DIR`` the wheels in DIR and its subfolders (scripts/fetch_gpu_wheels.sh) are installed
into the interpreter first, offline (``pip install --no-index --no-deps``). Everything is written under
``--out``: one log per stage, summary.json, and BENCHMARKS_section.md to paste into BENCHMARKS.md.
The targets (FP8 tensorwise >= 1.25x BF16 tokens/s, BF16 MFU >= 40%) are reported, not enforced:
a stage fails when its command fails, not when a speed target is missed.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import json
import os
import shlex
import shutil
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from torchtitan_lite.tools.gpu_check_figures import (
    BENCH_CONFIGS,
    PP_GPUS,
    benchmark_figure,
    bubble_figure,
    layer_bench_figure,
    loss_figure,
    pp_train_figure,
    pytest_figure,
)

REPO = Path(__file__).resolve().parents[2]
BUDGET_S = 9 * 60
"""One device command's share of a 10-minute limit (the rest: installing wheels, probing the interpreter).
The one-GPU stages' limits below, set from their times on an H200 (2026-11-27), add up to more: they run
as the groups in ``COMMAND_GROUPS``, each within this budget."""
COMMAND_GROUPS = ("ade", "bc")
"""One-GPU stages that fit one device command together: the tests, the loss check and the MoE throughput;
then the layer bench (blockwise autotunes torchao's Triton kernels per shape) and the dense throughput."""
BENCH_LAYERS = 4
MOE_BENCH_CONFIGS = ("qwen3_moe_30b_a3b", "qwen3_moe_30b_a3b_fp8")
MOE_BENCH_LAYERS = 2
STAGE_KEYS = "abcdefg"
PP_BUBBLE_ARGS = ("--flavor", "8B", "--n-layers", "8", "--seq-len", "1024", "--microbatch-size", "1",
                  "--n-microbatches", "8")
"""Stage g's model: 8B-width blocks (a ~9 ms forward per block at 1024 tokens in float32 on an H100), so
compute dominates the NCCL send/receive latency and the bubble shows."""
LAYER_RECIPES = ("tensorwise", "rowwise", "rowwise_with_gw_hp", "blockwise")
"""Stage b's recipes: torchao's float8 recipes and the float8_blockwise converter's Linear."""
LOSS_SEEDS = 3
"""Stage d trains each config once per seed: one seed's gap at the debug scale is mostly trajectory noise
(docs/mixed_precision.md, "Over three seeds"; on an H200, seed 0 alone gave -0.22 nats, three seeds
-0.07 +- 0.08 against a seed-to-seed spread of 0.36)."""
REQUIRED_MODULES = ("torch", "torchao", "datasets", "sentencepiece", "tensorboard", "safetensors", "pytest",
                    "matplotlib", "numpy")


@dataclass
class Stage:
    key: str
    name: str
    """Short name: the log is <key>_<name>.log in the output folder."""
    title: str
    command: list[str]
    timeout_s: int
    figure: Callable[[Path, str], tuple[bool, str]]
    """Reads the stage's outputs (its folder and its log text) -> (figures look sound, figure text)."""
    gpus: int = 1
    """GPUs the stage needs; on a machine with fewer it is skipped (``skip_stage``)."""


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
    """Not run: the machine has fewer GPUs than the stage needs (the figure says so). Does not fail the run."""


# --------------------------------------------------------------------------------------------------
# The stages


def build_stages(python: str, out: Path) -> list[Stage]:
    scripts = REPO / "scripts"
    return [
        Stage("a", "pytest", "pytest -m gpu (CUDA-only tests)",
              [python, "-m", "pytest", "-m", "gpu", "tests/gpu", "-q", "-p", "no:cacheprovider", "-rs",
               f"--junitxml={out / 'a_pytest.xml'}"], 270, pytest_figure),
        Stage("b", "float8_layer_bench", "float8 Linear bench, llama3_8b shapes, compiled",
              [python, str(scripts / "float8_layer_bench.py"), "--shapes", "llama3_8b", "--recipes", *LAYER_RECIPES],
              390, layer_bench_figure),
        Stage("c", "benchmark", f"training throughput, 8B width x {BENCH_LAYERS} layers, seq 8192, compiled",
              [python, str(scripts / "benchmark.py"), "--configs", *BENCH_CONFIGS, "--baseline", BENCH_CONFIGS[0],
               "--warmup", "3", "--steps", "10", "--model.n_layers", str(BENCH_LAYERS), "--training.seq_len", "8192",
               "--training.local_batch_size", "1", "--compile.enable", "true",
               # The published configs read the Llama 3 tokenizer and a streamed hub corpus; a GPU machine
               # without network has neither, and throughput does not depend on which tokens flow.
               "--data.dataset", "embedded", "--tokenizer.path", "none",
               "--metrics.enable_tensorboard", "false", "--title", f"llama3_8b width, {BENCH_LAYERS} layers, seq 8192",
               "--out-md", str(out / "c_benchmark.md"), "--json-out", str(out / "c_benchmark.json"),
               "--png", str(out / "c_benchmark.png"), "--logs", str(out / "c_logs")], 150,
              benchmark_figure("c_benchmark.json")),
        Stage("d", "loss_compare", f"loss curves, llama3_debug_bf16 vs llama3_debug_fp8, 200 steps x {LOSS_SEEDS} seeds",
              [python, str(scripts / "loss_compare.py"), "--configs", "llama3_debug_bf16", "llama3_debug_fp8",
               "--steps", "200", "--seeds", str(LOSS_SEEDS), "--parallel", str(2 * LOSS_SEEDS),
               "--out", str(out / "d_loss_compare.png"), "--table", str(out / "d_loss_compare.md"),
               "--dump-root", str(out / "d_runs")], 120, loss_figure),
        Stage("e", "moe_benchmark", f"MoE training throughput, Qwen3-30B-A3B width x {MOE_BENCH_LAYERS} blocks, "
                                    "seq 4096, eager",
              [python, str(scripts / "benchmark.py"), "--configs", *MOE_BENCH_CONFIGS, "--baseline",
               MOE_BENCH_CONFIGS[0], "--warmup", "3", "--steps", "10", "--model.n_layers", str(MOE_BENCH_LAYERS),
               "--training.seq_len", "4096", "--training.local_batch_size", "1", "--compile.enable", "false",
               "--data.dataset", "embedded", "--tokenizer.path", "none", "--metrics.enable_tensorboard", "false",
               "--title", f"qwen3_moe 30B-A3B width, {MOE_BENCH_LAYERS} blocks, seq 4096",
               "--out-md", str(out / "e_benchmark.md"), "--json-out", str(out / "e_benchmark.json"),
               "--logs", str(out / "e_logs")], 130, benchmark_figure("e_benchmark.json")),
        Stage("f", "pp_train", f"pipeline parallelism, llama3_debug, PP {PP_GPUS} x 1F1B, 20 steps",
              ["env", f"NGPU={PP_GPUS}", str(REPO / "run_train.sh"), "--config", "llama3_debug", "--parallelism.pp",
               str(PP_GPUS), "--parallelism.pipeline_schedule", "1F1B", "--training.steps", "20",
               "--metrics.log_freq", "1", "--metrics.enable_tensorboard", "false", "--checkpoint.enable", "false",
               "--validation.freq", "20", "--job.dump_folder", str(out / "f_run")], 90, pp_train_figure,
              gpus=PP_GPUS),
        Stage("g", "pipeline_bubble", f"pipeline bubble per schedule on {PP_GPUS} GPUs, 8B width x 8 blocks",
              [python, str(scripts / "pipeline_bubble.py"), "--device", "cuda", "--pp", str(PP_GPUS), *PP_BUBBLE_ARGS,
               "--out-md", str(out / "g_pipeline_bubble.md"), "--json-out", str(out / "g_pipeline_bubble.json")], 150,
              bubble_figure, gpus=PP_GPUS),
    ]


def select_stages(stages: list[Stage], keys: str) -> list[Stage]:
    """The stages named in ``keys``; one-GPU stages that leave part of the budget unused share it out.

    Run alone (``--stages b``), a one-GPU stage gets all 9 minutes; a choice whose limits add up to more
    keeps them (never cut below what the stage was measured to need). The multi-GPU stages keep their own.
    """
    chosen = [s for s in stages if s.key in keys]
    single = sum(s.timeout_s for s in chosen if s.gpus == 1)
    scale = max(1.0, BUDGET_S / single) if single else 1.0
    return [dataclasses.replace(s, timeout_s=int(s.timeout_s * scale)) if s.gpus == 1 else s for s in chosen]


def group_limit(keys: str) -> int:
    """Seconds the one-GPU stages in ``keys`` may take together, at their own limits."""
    return sum(s.timeout_s for s in build_stages("python", Path(".")) if s.key in keys and s.gpus == 1)


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


def run_stage(stage: Stage, out: Path, env: dict[str, str]) -> StageResult:
    log_path = out / f"{stage.key}_{stage.name}.log"
    print(f"[{stage.key}] {stage.title}\n    $ {shlex.join(stage.command)}", flush=True)
    start = time.perf_counter()
    exit_code: int | None
    with open(log_path, "w") as log:
        try:
            exit_code = subprocess.run(stage.command, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, env=env,
                                       timeout=stage.timeout_s).returncode
        except subprocess.TimeoutExpired:
            exit_code = None
    seconds = time.perf_counter() - start
    text = log_path.read_text(errors="replace")
    try:
        sound, figure = stage.figure(out, text)
    except (OSError, ValueError, KeyError, ET.ParseError) as err:
        sound, figure = False, f"could not read the stage's results: {err}"
    if exit_code is None:
        sound, figure = False, f"timed out after {stage.timeout_s} s; {figure}"
    elif exit_code != 0:
        sound, figure = False, f"exit {exit_code}; {figure}"
    result = StageResult(stage.key, stage.title, shlex.join(stage.command), sound, figure, seconds, exit_code,
                         str(log_path.relative_to(out)))
    print(f"[{stage.key}] {'PASS' if sound else 'FAIL'} in {seconds:.0f} s: {figure}", flush=True)
    if not sound:
        print("    last lines of the log:\n" + "".join(f"    {line}\n" for line in text.splitlines()[-15:]), flush=True)
    return result


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


def markdown_section(results: list[StageResult], info: dict[str, str], command: str, out: Path) -> str:
    lines = [f"## GPU acceptance run on {info['gpus']} x {info['device']} ({info['date']})", "",
             f"- device: {info['gpus']} x {info['device']}, driver {info['driver']}, CUDA {info['cuda']}",
             f"- torch {info['torch']}, torchao {info['torchao']}; commit {info['commit']}; {info['date']}",
             f"- command: `{command}`", "",
             "| stage | result | figure | seconds |", "|---|---|---|---:|"]
    for r in results:
        figure = r.figure.replace("|", "\\|")
        verdict = "skipped" if r.skipped else "pass" if r.passed else "**FAIL**"
        lines.append(f"| {r.key}. {r.title} | {verdict} | {figure} | {r.seconds:.0f} |")
    for name, heading in (("c_benchmark.md", None), ("d_loss_compare.md", "Loss comparison (stage d)"),
                          ("e_benchmark.md", None)):
        path = out / name
        if path.exists():
            lines += ["", f"### {heading}" if heading else "", path.read_text().strip()]
    bench_log = out / "b_float8_layer_bench.log"
    if bench_log.exists():
        table = [line for line in bench_log.read_text().splitlines() if line.startswith("|")]
        if table:
            lines += ["", "### float8 Linear forward+backward (stage b)", "", *table]
    return "\n".join(line for line in lines) + "\n"


# --------------------------------------------------------------------------------------------------


def default_out() -> Path:
    commit = _command_output(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"]) or "nocommit"
    return REPO / "gpu_check" / f"{dt.datetime.now(dt.timezone.utc):%Y%m%d-%H%M}-{commit}"


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="scripts/gpu_check.sh", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__.split("\n\n", 1)[1])
    parser.add_argument("--plan", action="store_true", help="print the commands it would run and exit 0 (no GPU needed)")
    parser.add_argument("--out", type=Path, default=None, help="output folder (default gpu_check/<date>-<commit>)")
    parser.add_argument("--wheels", type=Path, default=None,
                        help="install the wheels in this folder first (pip --no-index --no-deps; "
                             "scripts/fetch_gpu_wheels.sh makes it)")
    parser.add_argument("--stages", default=STAGE_KEYS, help=f"which stages to run, e.g. 'cd' (default: {STAGE_KEYS})")
    args = parser.parse_args(argv)
    unknown = set(args.stages) - set(STAGE_KEYS)
    if unknown or not args.stages:
        parser.error(f"--stages takes letters from '{STAGE_KEYS}', got {args.stages!r}")
    if args.wheels is not None and not any(args.wheels.rglob("*.whl")):
        parser.error(f"--wheels {args.wheels}: no .whl files there; make the folder with scripts/fetch_gpu_wheels.sh DIR")
    return args


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    python = _interpreter(os.environ.get("TTL_PYTHON") or sys.executable)
    out = (args.out or default_out()).resolve()
    stages = select_stages(build_stages(python, out), args.stages)
    setup = wheel_install_command(python, args.wheels) if args.wheels else None
    if args.plan:
        single = sum(s.timeout_s for s in stages if s.gpus == 1)
        groups = ", ".join(f"--stages {g} ({group_limit(g)} s)" for g in COMMAND_GROUPS)
        print(f"# gpu_check plan: run from {REPO} with PYTHONPATH={REPO}; output under {out}; interpreter {python}; "
              f"one-GPU stage limits add up to {single} s, stages needing {PP_GPUS}+ GPUs "
              f"add {sum(s.timeout_s for s in stages) - single} s where they run; one device command of "
              f"{BUDGET_S} s fits {groups} (the same --out merges them)")
        if setup:
            print(f"# setup: install the carried wheels\n{shlex.join(setup)}")
        for s in stages:
            needs = f"; needs {s.gpus} GPUs, skipped on a machine with fewer" if s.gpus > 1 else ""
            print(f"# stage {s.key}: {s.title} (limit {s.timeout_s} s{needs})\n{shlex.join(s.command)}")
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
    out.mkdir(parents=True, exist_ok=True)  # only now: a refused check leaves no output folder behind
    print(f"gpu_check: {info['gpus']} x {info['device']}, driver {info['driver']}, torch {info['torch']}, "
          f"torchao {info['torchao']}, commit {info['commit']}; output in {out}", flush=True)

    env = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONPATH=os.pathsep.join(
        p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p))
    gpus = int(info["gpus"])
    results = merge_results(out, [run_stage(stage, out, env) if (reason := skip_reason(stage, gpus)) is None
                                  else skip_stage(stage, reason) for stage in stages])

    command = shlex.join(["scripts/gpu_check.sh", *argv])
    section = markdown_section(results, info, command, out)
    (out / "BENCHMARKS_section.md").write_text(section)
    (out / "summary.json").write_text(json.dumps({"environment": info, "command": command,
                                                  "stages": [asdict(r) for r in results]}, indent=2) + "\n")
    failed = [r.key for r in results if not r.passed]
    skipped = [r.key for r in results if r.skipped]
    ran = len(results) - len(skipped)
    print(f"\ngpu_check: {ran - len(failed)} of {ran} stages passed"
          f"{'; failed: ' + ', '.join(failed) if failed else ''}"
          f"{'; skipped (too few GPUs): ' + ', '.join(skipped) if skipped else ''}. Markdown for BENCHMARKS.md: "
          f"{out / 'BENCHMARKS_section.md'}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
