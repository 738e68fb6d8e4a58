"""Cold and warm torch.compile time of the transformer blocks at several depths, ours against upstream
torchtitan's on the same model.

    python scripts/compile_time_bench.py                                   # debug and 8B width, 2 / 4 / 8 layers
    python scripts/compile_time_bench.py --sizes debug --layers 2 8 --out-md BENCHMARKS.md --append

Both trainers compile each transformer block on its own (``Module.compile``, fullgraph, inductor), ours
with ``torchtitan_lite.distributed.compile.apply_compile`` and torchtitan with its own ``apply_compile``,
on the same model (torchtitan's is generated from our model arguments as in
scripts/torchtitan_side_by_side.py, in the environment that script makes). Each measurement is one
process timing its first forward + backward against the median of the next ``--steps``
(``protocol.py``): "cold" starts with an empty inductor cache folder, "warm" is a second process on the
cache the cold one filled (FX graph and kernel caches hit; dynamo still traces). Sizes:

- ``debug``: our debug flavor (dim 256, 8 heads, 4 KV heads), float32, batch 16 x 128 tokens;
- ``8b``: the 8B flavor's width (dim 4096, 32 heads, 8 KV heads, FFN 14336), bfloat16 parameters and
  compute (float32 weights and gradients of 8 blocks need 14 GB), batch 1 x 128 tokens.

Both use a 2,048-token vocabulary: embeddings and the output projection are not compiled, and the
8B flavor's 128,256 rows would add 2.1 GB for nothing. No optimizer runs (compile time does not involve it).
"""
from __future__ import annotations

import argparse
import datetime
import os
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from torchtitan_lite.tools.benchmark.report import write_markdown
from torchtitan_lite.tools.benchmark.run_info import cpu_description, git_commit, load_average
from torchtitan_lite.tools.compile_time.protocol import parse_result
from torchtitan_lite.tools.repo import REPO_ROOT, SCRIPTS_DIR
from torchtitan_lite.tools.torchtitan_side_by_side.environment import ensure_venv
from torchtitan_lite.tools.torchtitan_side_by_side.torchtitan_config import Settings, torchtitan_config_source


@dataclass(frozen=True)
class Size:
    flavor: str
    dtype: str
    batch: int
    seq_len: int
    vocab_size: int = 2048


SIZES = {
    "debug": Size(flavor="debug", dtype="float32", batch=16, seq_len=128),
    "8b": Size(flavor="8B", dtype="bfloat16", batch=1, seq_len=128),
}
TRAINERS = ("torchtitan", "torchtitan_lite")


@dataclass
class Row:
    size: str
    layers: int
    measured: dict[tuple[str, str], dict[str, Any]] = field(default_factory=dict)
    """(trainer, 'cold' | 'warm') -> protocol.measure's result."""
    commands: dict[str, list[str]] = field(default_factory=dict)


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", nargs="+", choices=sorted(SIZES), default=["debug", "8b"])
    parser.add_argument("--layers", nargs="+", type=int, default=[2, 4, 8], help="depths (default 2 4 8)")
    parser.add_argument("--trainers", nargs="+", choices=TRAINERS, default=list(TRAINERS))
    parser.add_argument("--steps", type=int, default=3, help="steps after the first; their median is the steady step")
    parser.add_argument("--torchtitan-version", default="0.3.0")
    parser.add_argument("--venv", type=Path, default=REPO_ROOT / ".cache" / "torchtitan_venv",
                        help="torchtitan's virtual environment, created when missing")
    parser.add_argument("--run-dir", type=Path, default=REPO_ROOT / ".cache" / "compile_time",
                        help="generated torchtitan configs, inductor cache folders and logs")
    parser.add_argument("--out-md", type=Path, help="write a markdown section with the table here")
    parser.add_argument("--append", action="store_true", help="append to --out-md instead of overwriting it")
    args = parser.parse_args(argv)
    if any(n < 1 for n in args.layers) or args.steps < 1:
        parser.error("--layers and --steps must be positive")
    if args.append and args.out_md is None:
        parser.error("--append needs --out-md")
    return args


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    args.run_dir.mkdir(parents=True, exist_ok=True)
    python, versions = (ensure_venv(args.venv, args.torchtitan_version) if "torchtitan" in args.trainers
                        else (None, {}))
    rows = []
    load_start = load_average()
    for size_name in args.sizes:
        for layers in args.layers:
            row = Row(size_name, layers)
            for trainer in args.trainers:
                cmd = (torchtitan_command(python, args, size_name, layers) if trainer == "torchtitan"
                       else our_command(args, size_name, layers))
                cache = args.run_dir / "inductor" / f"{trainer}-{size_name}-{layers}"
                shutil.rmtree(cache, ignore_errors=True)
                for temperature in ("cold", "warm"):
                    log = args.run_dir / f"{trainer}-{size_name}-{layers}-{temperature}.log"
                    measured = row.measured[(trainer, temperature)] = run_measurement(cmd, cache, log)
                    print(f"  {size_name} {layers} layers {trainer} {temperature}: {measured['compile_s']:.1f} s",
                          flush=True)
                row.commands[trainer] = cmd
            params = {trainer: row.measured[(trainer, "cold")]["params"] for trainer in args.trainers}
            if len(set(params.values())) > 1:
                raise SystemExit(f"error: the models differ ({size_name}, {layers} layers): parameters {params}")
            rows.append(row)
    text = report_text(args, rows, versions, load_start, load_average())
    print(text)
    if args.out_md:
        write_markdown(args.out_md, text, append=args.append)
        print(f"markdown {'appended to' if args.append else 'written to'} {args.out_md}")
    return 0


def run_measurement(cmd: list[str], cache: Path, log: Path) -> dict[str, Any]:
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(cache), PYTHONUNBUFFERED="1")
    result = subprocess.run(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True)
    log.write_text(result.stdout + result.stderr)
    measured = parse_result(result.stdout)
    if result.returncode != 0 or measured is None:
        tail = "".join((result.stdout + result.stderr).splitlines(keepends=True)[-30:])
        raise SystemExit(f"error: {shlex.join(cmd)} failed (exit {result.returncode}); last lines of {log}:\n{tail}")
    return measured


def our_command(args: argparse.Namespace, size_name: str, layers: int) -> list[str]:
    size = SIZES[size_name]
    return [sys.executable, str(SCRIPTS_DIR / "_compile_time_worker.py"), "--flavor", size.flavor, "--layers",
            str(layers), "--vocab-size", str(size.vocab_size), "--dtype", size.dtype, "--batch", str(size.batch),
            "--seq-len", str(size.seq_len), "--steps", str(args.steps)]


def torchtitan_command(python: Path | None, args: argparse.Namespace, size_name: str, layers: int) -> list[str]:
    """torchtitan's measuring command; its config module (our model arguments) is written first."""
    assert python is not None
    size = SIZES[size_name]
    module = f"ttl_compile_{size_name}_{layers}"
    source = torchtitan_config_source(model_settings(size, layers), tokenizer_dir=args.run_dir, data_dir=args.run_dir)
    (args.run_dir / f"{module}.py").write_text(source)
    return ["env", f"PYTHONPATH={args.run_dir}", str(python), str(SCRIPTS_DIR / "_torchtitan_cpu.py"), "compile-time",
            "--module", module, "--dtype", size.dtype, "--batch", str(size.batch), "--seq-len", str(size.seq_len),
            "--steps", str(args.steps)]


def model_settings(size: Size, layers: int) -> Settings:
    """The side-by-side settings of our model at ``size`` and depth; only the model fields are used here."""
    from torchtitan_lite.protocols.model_spec import build_model_args, get_model_spec

    a = build_model_args(get_model_spec("llama3"), size.flavor, n_layers=layers, vocab_size=size.vocab_size)
    return Settings(
        dim=a.dim, n_layers=a.n_layers, n_heads=a.n_heads, n_kv_heads=a.kv_heads,
        vocab_size=a.vocab_size, ffn_hidden_dim=a.ffn_hidden_dim, norm_eps=a.norm_eps, rope_theta=a.rope_theta,
        max_seq_len=a.max_seq_len, seq_len=size.seq_len, local_batch_size=size.batch,
        # Training settings are part of the generated module but play no part in a compile-time measurement.
        lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0, warmup_steps=1, decay_type="linear",
        decay_ratio=None, min_lr_factor=0.0, max_norm=1.0, gc_freq=50, seed=0, param_dtype=size.dtype,
    )


def report_text(args: argparse.Namespace, rows: list[Row], versions: dict[str, str],
                load_start: float | None, load_end: float | None) -> str:
    import torch

    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    load = (f"host load average {load_start:.1f} at the start, {load_end:.1f} at the end; "
            if load_start is not None and load_end is not None else "")
    ours, theirs = "torchtitan_lite", "torchtitan"
    both = ours in args.trainers and theirs in args.trainers
    lines = [
        "### Cold and warm compile time of the transformer blocks",
        "",
        f"- device: {cpu_description(torch.get_num_threads())}; {load}{date}; commit {git_commit()}; torch "
        f"{torch.__version__}" + (f", torchtitan {versions['torchtitan']} in its own environment" if versions else ""),
        f"- command: `{shlex.join(['python', 'scripts/compile_time_bench.py', *sys.argv[1:]])}`",
        "- compile time: first forward + backward minus the median of the next "
        f"{args.steps} (one process each; cold: empty inductor cache, warm: a second process on that cache); "
        "graphs: distinct graphs dynamo compiled for the blocks",
        "- sizes: " + "; ".join(f"`{name}` = {s.flavor} flavor width, {s.dtype}, batch {s.batch} x {s.seq_len}, "
                               f"vocabulary {s.vocab_size}" for name, s in SIZES.items() if name in args.sizes),
        "",
    ]
    header = ["size", "layers", "parameters"]
    for trainer in args.trainers:
        header += [f"{trainer} cold s", f"{trainer} warm s", f"{trainer} graphs"]
    header.append(f"{ours} cold / its shallowest" if ours in args.trainers else "")
    if both:
        header.append(f"{ours} cold / {theirs} cold")
    header = [h for h in header if h]
    lines += ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    shallowest: dict[str, Row] = {}
    for row in rows:
        if row.size not in shallowest or row.layers < shallowest[row.size].layers:
            shallowest[row.size] = row
    for row in rows:
        m = row.measured
        cells = [f"`{row.size}`", str(row.layers), f"{m[(args.trainers[0], 'cold')]['params']:,}"]
        for trainer in args.trainers:
            cells += [f"{m[(trainer, 'cold')]['compile_s']:.1f}", f"{m[(trainer, 'warm')]['compile_s']:.1f}",
                      str(m[(trainer, 'cold')]['graphs'])]
        if ours in args.trainers:
            base = shallowest[row.size].measured[(ours, "cold")]["compile_s"]
            cells.append(f"{m[(ours, 'cold')]['compile_s'] / base:.2f}x")
        if both:
            cells.append(f"**{m[(ours, 'cold')]['compile_s'] / m[(theirs, 'cold')]['compile_s']:.2f}x**")
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "Commands (each run with `TORCHINDUCTOR_CACHE_DIR` set to its own folder):", ""]
    for row in rows:
        for trainer in args.trainers:
            lines.append(f"- `{row.size}` {row.layers} layers, {trainer}: `{_display(row.commands[trainer])}`")
    lines.append("")
    return "\n".join(lines)


def _display(cmd: list[str]) -> str:
    return shlex.join(arg.replace(str(REPO_ROOT) + os.sep, "") for arg in cmd)

