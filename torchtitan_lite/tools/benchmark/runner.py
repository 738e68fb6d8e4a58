"""Training throughput of registry configs side by side: tokens/s, TFLOP/s, MFU, memory, compile time,
speedup over a baseline, and optionally the trainer's overhead over a bare hand-written loop.

    python scripts/benchmark.py --configs llama3_debug llama3_debug_bf16 --baseline llama3_debug \\
        --warmup 3 --steps 20 --bare-loop --out-md BENCHMARKS.md --append --png bench.png
    python scripts/benchmark.py --configs llama3_8b llama3_8b_fp8 --model.n_layers 4 --steps 30

Each config runs in its own process (scripts/_bench_worker.py; with ``--nproc N`` under torchrun), so
peak memory belongs to that config alone and no compiled or cached state leaks between configs. The
worker builds the trainer as train.py does and runs its real ``train()`` loop for ``warmup + steps``
steps; the warm-up steps (which include compilation) are excluded, and each timed step is measured
from the end of one ``train_step`` to the end of the next, i.e. the full loop iteration. Flags of the
form ``--section.field VALUE`` are applied to every config (validation is off unless turned on).

Numbers reported per config:

- tokens/s per device (a tensor-parallel group shares its tokens) and in total (x data-parallel ranks);
- TFLOP/s per device from the model's ``flops_per_token`` (6N + attention, as torchtitan counts);
- MFU against the device's dense BF16 peak on GPUs (torchtitan_lite/components/device_peaks.py); on
  a CPU against the float32 matmul rate measured once here (``--cpu-peak-tflops`` to give it), the
  CPU's fastest dense format, so every precision is on one scale as on GPUs;
- peak memory: CUDA max allocated / max reserved over the steps; CPU peak resident set size;
- cold compile time: step 1's ``train_step`` minus the median timed one (only with compile on);
- speedup: total tokens/s over the baseline's;
- with ``--bare-loop``: the bare hand-written loop's tokens/s (scripts/bare_loop.py: same model, data,
  optimizer and precision) and the trainer's step over the bare step, both run in one process with
  their steps alternated so that machine load hits both alike; the trainer's loop around
  ``train_step`` is the separate "outside train_step" share.

``--repeats R`` runs every measurement R times, interleaving configs, and keeps each one's fastest
run: on a shared machine other work only ever slows a run down.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from torchtitan_lite.config.registry import ConfigRegistry
from torchtitan_lite.tools.benchmark.measurement import BareMeasurement, Measurement
from torchtitan_lite.tools.benchmark.report import build_rows, markdown_section, save_bar_chart, write_markdown
from torchtitan_lite.tools.benchmark.run_info import load_average, run_info
from torchtitan_lite.tools.repo import REPO_ROOT, SCRIPTS_DIR

# Owned by the benchmark: steps come from --warmup/--steps, and the config is chosen by --configs.
RESERVED_FLAGS = ("--training.steps", "--config", "--config-file")


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Any --section.field VALUE flag (as in train.py) is applied to every config.")
    parser.add_argument("--configs", nargs="+", required=True, metavar="NAME", help="registry configs to measure")
    parser.add_argument("--baseline", metavar="NAME", help="config the speedups refer to (default: the first)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps first, compile included (default 3)")
    parser.add_argument("--steps", type=int, default=20, help="timed steps (default 20)")
    parser.add_argument("--repeats", type=int, default=1, help="runs per measurement, the fastest kept (default 1)")
    parser.add_argument("--time-budget", type=float, default=None, metavar="SECONDS",
                        help="start another round of --repeats only when the last round's time still fits in "
                             "this many seconds since the start (the first round always runs)")
    parser.add_argument("--profile-steps", type=int, default=0,
                        help="after each config's timed steps (first round), this many more under torch.profiler, "
                             "written to --profile-dir/<config>.json (tools/step_profile.py)")
    parser.add_argument("--profile-dir", type=Path, help="folder for the --profile-steps profiles")
    parser.add_argument("--bare-loop", action="store_true",
                        help="also time scripts/bare_loop.py on each config it supports and report trainer / bare")
    parser.add_argument("--nproc", type=int, default=1, help="processes per config, via torchrun (default 1)")
    parser.add_argument("--cpu-peak-tflops", type=float,
                        help="CPU peak for MFU; default: measure the float32 matmul rate once")
    parser.add_argument("--title", help="heading of the markdown section")
    parser.add_argument("--out-md", type=Path, help="write the markdown section here")
    parser.add_argument("--append", action="store_true", help="append to --out-md instead of overwriting it")
    parser.add_argument("--png", type=Path, help="save a bar chart of tokens/s here")
    parser.add_argument("--json-out", type=Path, help="write the table's rows (and peak memory in GiB) as JSON here")
    parser.add_argument("--logs", type=Path, help="keep the workers' logs in this folder (default: a temp folder)")
    args, overrides = parser.parse_known_args(argv)
    _check(parser, args, overrides)
    return args, overrides


def _check(parser: argparse.ArgumentParser, args: argparse.Namespace, overrides: list[str]) -> None:
    if args.warmup < 1 or args.steps < 1:
        parser.error("--warmup and --steps must both be >= 1 (the first step includes one-off costs)")
    if args.repeats < 1 or args.nproc < 1:
        parser.error("--repeats and --nproc must be >= 1")
    if args.baseline is not None and args.baseline not in args.configs:
        parser.error(f"--baseline {args.baseline} is not one of --configs ({', '.join(args.configs)})")
    if len(set(args.configs)) != len(args.configs):
        parser.error("--configs lists a config twice")
    if args.append and args.out_md is None:
        parser.error("--append needs --out-md")
    if args.profile_steps < 0 or (args.profile_steps > 0) != (args.profile_dir is not None):
        parser.error("--profile-steps N (>= 1) and --profile-dir DIR go together")
    for flag in overrides:
        name = flag.split("=", 1)[0]
        if name in RESERVED_FLAGS:
            parser.error(f"{name} is set by the benchmark: use --configs, --warmup and --steps")
        if name.startswith("-") and "." not in name:
            parser.error(f"unknown flag {name}; config overrides look like --section.field VALUE")


def main(argv: list[str], *, registry: ConfigRegistry) -> int:
    """Measure every config of ``--configs`` (names in ``registry``) and print / write the report."""
    args, overrides = parse_args(argv)
    baseline = args.baseline or args.configs[0]
    configs = _resolve(args.configs, overrides, registry)  # fails fast on a bad name or override
    device_type = "cuda" if _cuda_available() else "cpu"
    peak_override, peak_note = _peak(args, device_type)
    logs = args.logs or Path(tempfile.mkdtemp(prefix="benchmark_"))
    logs.mkdir(parents=True, exist_ok=True)
    if args.profile_dir:
        args.profile_dir.mkdir(parents=True, exist_ok=True)

    load_before = load_average()
    measured: dict[str, Measurement] = {}
    bare: dict[str, BareMeasurement] = {}
    bare_notes: dict[str, str] = {}
    started = time.perf_counter()
    rounds = 0
    for repeat in range(args.repeats):
        round_start = time.perf_counter()
        rounds += 1
        for name in args.configs:
            profile = args.profile_dir / f"{name}.json" if args.profile_steps and repeat == 0 else None
            m = _run_worker(name, overrides + peak_override, args, logs / f"{name}.{repeat}.trainer", profile)
            if name not in measured or _tokens_per_s(m) > _tokens_per_s(measured[name]):
                measured[name] = m
            if not args.bare_loop:
                continue
            reason = "parallelism (it is a single-process loop)" if args.nproc > 1 else _bare_unsupported(configs[name])
            if reason is not None:
                bare_notes[name] = f"n/a ({reason})"
                continue
            b = _run_bare(name, overrides + peak_override, args, logs / f"{name}.{repeat}.bare")
            if name not in bare or b.tokens_per_s > bare[name].tokens_per_s:
                bare[name] = b
        done = time.perf_counter()
        if (repeat + 1 < args.repeats and args.time_budget is not None
                and done - started + (done - round_start) > args.time_budget):
            print(f"stopping after {repeat + 1} of {args.repeats} rounds: another would pass --time-budget "
                  f"{args.time_budget:.0f} s", flush=True)
            break

    measurements = [measured[name] for name in args.configs]
    rows = build_rows(measurements, baseline, bare, bare_notes)
    first = measurements[0]
    info = run_info(device=first.device_name if first.device_type == "cpu" else f"{args.nproc} x {first.device_name}",
                    peak_note=peak_note, command=_command(argv), warmup=args.warmup, steps=args.steps,
                    repeats=rounds, load=_load_text(load_before, load_average()))
    title = args.title or f"{', '.join(args.configs)} on {first.device_name}"
    memory_note = ("max allocated / max reserved (CUDA caching allocator)" if first.device_type == "cuda"
                   else "peak resident set size of the config's process")
    section = markdown_section(rows, info, baseline=baseline, title=title, memory_note=memory_note)
    print(section)
    if args.out_md:
        write_markdown(args.out_md, section, append=args.append)
        print(f"markdown {'appended to' if args.append else 'written to'} {args.out_md}")
    if args.json_out:
        _write_json(args.json_out, rows, measurements, info.peak_note, baseline)
        print(f"rows written to {args.json_out}")
    if args.png:
        save_bar_chart(rows, args.png, title=title, baseline=baseline)
        print(f"chart saved to {args.png}")
    print(f"worker logs in {logs}")
    return 0


def _resolve(names: list[str], overrides: list[str], registry: ConfigRegistry) -> dict[str, Any]:
    from torchtitan_lite.config import ConfigError, parse_cli

    configs = {}
    for name in names:
        try:
            configs[name] = parse_cli(["--config", name, *overrides], registry=registry).config
        except ConfigError as err:
            raise SystemExit(f"error: {err}") from None
    return configs


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def _write_json(path: Path, rows: list, measurements: list[Measurement], peak_note: str, baseline: str) -> None:
    out = []
    for row, m in zip(rows, measurements):
        out.append(asdict(row) | {"peak_memory_gib": m.peak_memory_gib, "peak_reserved_gib": m.peak_reserved_gib,
                                  "device": m.device_name})
    path.write_text(json.dumps({"baseline": baseline, "mfu_against": peak_note, "rows": out}, indent=2) + "\n")


def _peak(args: argparse.Namespace, device_type: str) -> tuple[list[str], str]:
    """Overrides that give every worker the same CPU peak, and what MFU is measured against."""
    if device_type == "cuda":
        import torch

        from torchtitan_lite.components.device_peaks import gpu_bf16_peak_flops

        name = torch.cuda.get_device_name()
        peak = gpu_bf16_peak_flops(name)
        if peak is None:
            return [], (f"nothing: {name} is not in torchtitan_lite/components/device_peaks.py, so MFU is not "
                        f"reported (add its dense BF16 peak there)")
        return [], f"the {name}'s dense BF16 peak, {peak / 1e12:.0f} TFLOP/s (device_peaks.py)"
    tflops = args.cpu_peak_tflops
    if tflops is None:
        from torchtitan_lite.components.device_peaks import measure_cpu_peak_tflops

        dtype, tflops = measure_cpu_peak_tflops()
        note = (f"this CPU's best {str(dtype).removeprefix('torch.')} matmul rate (its fastest native dtype), "
                f"measured here: {tflops:.3f} TFLOP/s")
    else:
        note = f"a given CPU peak of {tflops:.3f} TFLOP/s"
    return ["--metrics.cpu_peak_tflops", repr(tflops)], note


def _run_worker(name: str, overrides: list[str], args: argparse.Namespace, stem: Path,
                profile: Path | None = None) -> Measurement:
    json_out = Path(f"{stem}.json")
    profiling = ["--profile-steps", str(args.profile_steps), "--profile-out", str(profile)] if profile else []
    script = [str(SCRIPTS_DIR / "_bench_worker.py")]
    if args.nproc > 1:
        launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.nproc}"]
    else:
        launcher = [sys.executable]
    cmd = [*launcher, *script, "--json-out", str(json_out), "--warmup", str(args.warmup), "--steps",
           str(args.steps), *profiling, "--config", name, *overrides]
    _run(cmd, Path(f"{stem}.log"), f"{name} (trainer)")
    return Measurement.from_json(json.loads(json_out.read_text()))


def _run_bare(name: str, overrides: list[str], args: argparse.Namespace, stem: Path) -> BareMeasurement:
    json_out = Path(f"{stem}.json")
    cmd = [sys.executable, str(SCRIPTS_DIR / "bare_loop.py"), "--against-trainer", "--json-out", str(json_out),
           "--warmup", str(args.warmup), "--steps", str(args.steps), "--config", name, *overrides]
    _run(cmd, Path(f"{stem}.log"), f"{name} (bare loop)")
    return BareMeasurement.from_json(json.loads(json_out.read_text()))


def _run(cmd: list[str], log: Path, what: str) -> None:
    print(f"measuring {what} ...", flush=True)
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    with open(log, "w") as out:
        result = subprocess.run(cmd, cwd=REPO_ROOT, stdout=out, stderr=subprocess.STDOUT, env=env)
    if result.returncode != 0:
        tail = "".join(log.read_text().splitlines(keepends=True)[-30:])
        raise SystemExit(f"error: {what} failed (exit {result.returncode}); last lines of {log}:\n{tail}")


def _bare_unsupported(config: Any) -> str | None:
    from torchtitan_lite.tools.bare_loop import unsupported_reason

    return unsupported_reason(config)


def _tokens_per_s(m: Measurement) -> float:
    return m.tokens_per_step / (sum(m.step_s) / len(m.step_s))


def _load_text(before: float | None, after: float | None) -> str:
    if before is None or after is None:
        return ""
    return f"{before:.1f} at the start, {after:.1f} at the end (1-minute averages)"


def _command(argv: list[str]) -> str:
    return shlex.join(["python", "scripts/benchmark.py", *argv])

