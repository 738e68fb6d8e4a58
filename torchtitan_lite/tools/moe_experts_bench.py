"""Routed experts on this machine, forward + backward: grouped GEMMs (``torch._grouped_mm``) against the
per-expert loop, the whole MoE layer, and the whole qwen3_moe debug model; optionally the same layer and model
of torchtitan 0.3.0 (its Qwen3 MoE) on the same shapes, in its own environment.

    python scripts/moe_experts_bench.py                        # debug and larger shapes, float32 and bf16
    python scripts/moe_experts_bench.py --torchtitan-python /tmp/ttvenv/bin/python --out-md moe.md

Rows (``tokens/s`` counts the batch's tokens, each routed to top_k experts; median of ``--repeats`` timed
forward + backward passes after ``--warmup`` untimed ones, fastest of ``--rounds``: each round times every
row, ours then torchtitan's, so that a busy spell on a shared machine slows both sides alike):

- ``experts, grouped`` / ``experts, loop``: the experts alone on the rows of one routing (sorted by expert, the
  tokens per expert of a top-k choice over random scores), grouped GEMMs or one F.linear SwiGLU per expert;
- ``MoE layer``: router (float32 gate) + dispatch + grouped experts + combine, from [batch, seq, dim];
- ``qwen3_moe debug model``: tokens to cross-entropy loss (shapes: ``debug`` only).

``bfloat16`` is autocast over float32 parameters, as a one-process bf16 run computes; torchtitan's experts
cast to bf16 inside whatever the dtype (its GroupedExperts), so its float32 rows run bf16 expert GEMMs.

The module needs only the standard library and torch at import: torchtitan's environment imports
``median_tokens_per_s`` from it.
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import platform
import statistics
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

DTYPES = ("float32", "bfloat16")


@dataclass(frozen=True)
class Shape:
    name: str
    dim: int
    hidden_dim: int
    num_experts: int
    top_k: int
    batch: int
    seq: int

    @property
    def tokens(self) -> int:
        return self.batch * self.seq

    def describe(self) -> str:
        return (f"{self.name}: dim {self.dim}, expert hidden {self.hidden_dim}, {self.num_experts} experts top-"
                f"{self.top_k}, batch {self.batch} x seq {self.seq} = {self.tokens} tokens")


SHAPES = {
    # qwen3_moe debug flavor with qwen3_moe_debug's batch (16 x 128).
    "debug": Shape("debug", dim=128, hidden_dim=128, num_experts=8, top_k=2, batch=16, seq=128),
    # The experts of torchtitan's Qwen3 debugmodel_moe (64 experts of width 768, top-8, dim 256).
    "larger": Shape("larger", dim=256, hidden_dim=768, num_experts=64, top_k=8, batch=4, seq=512),
}


@dataclass(frozen=True)
class Row:
    case: str
    impl: str
    shape: str
    dtype: str
    tokens_per_s: float
    ms: float


ExpertsFactory = Callable[[Shape, bool], nn.Module]
"""(shape, use_grouped_mm) -> the model's GroupedExperts, initialised."""
LayerFactory = Callable[[Shape], nn.Module]
"""shape -> the model's MoE layer, initialised, in training mode."""
ModelFactory = Callable[[], tuple[nn.Module, int]]
"""() -> (the qwen3_moe debug model, initialised, in training mode; its vocabulary size)."""


def median_tokens_per_s(step: Callable[[], None], tokens: int, *, warmup: int, repeats: int) -> tuple[float, float]:
    """(tokens / median seconds, median milliseconds) of ``repeats`` timed calls of ``step`` after ``warmup``."""
    for _ in range(warmup):
        step()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    median = statistics.median(times)
    return tokens / median, median * 1e3


@contextlib.contextmanager
def compute_dtype(dtype: str) -> Iterator[None]:
    """bf16 autocast over float32 parameters (a one-process bf16 run), or nothing for float32."""
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == "bfloat16"):
        yield


def routed_rows(shape: Shape, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(x [tokens * top_k, dim] float32 sorted by expert, counts [E] int64) of a top-k choice over random scores."""
    g = torch.Generator().manual_seed(seed)
    experts = torch.randn(shape.tokens, shape.num_experts, generator=g).topk(shape.top_k, dim=-1).indices
    counts = torch.bincount(experts.flatten(), minlength=shape.num_experts)
    return torch.randn(shape.tokens * shape.top_k, shape.dim, generator=g), counts


def bench_experts(build: ExpertsFactory, shape: Shape, dtype: str, *, warmup: int, repeats: int) -> list[Row]:
    x, counts = routed_rows(shape)
    rows = []
    for impl, grouped in (("grouped", True), ("loop", False)):
        experts = build(shape, grouped)
        inputs = x.clone().requires_grad_()

        def step(experts: nn.Module = experts, inputs: torch.Tensor = inputs) -> None:
            with compute_dtype(dtype):
                out = experts(inputs, counts)
            out.backward(_output_grad(out))

        rate, ms = median_tokens_per_s(step, shape.tokens, warmup=warmup, repeats=repeats)
        rows.append(Row("experts", impl, shape.name, dtype, rate, ms))
    return rows


def layer_step(layer: nn.Module, shape: Shape, dtype: str) -> Callable[[], None]:
    """One forward + backward of an MoE layer on [batch, seq, dim] inputs (shared with torchtitan's side)."""
    x = torch.randn(shape.batch, shape.seq, shape.dim, generator=torch.Generator().manual_seed(0)).requires_grad_()

    def step() -> None:
        with compute_dtype(dtype):
            out = layer(x)
        out.backward(_output_grad(out))

    return step


def _output_grad(out: torch.Tensor) -> torch.Tensor:
    """A dense output gradient, as the next layer hands back (``out.sum().backward()`` would hand an expanded
    one with zero strides, which torch._grouped_mm's backward refuses: "Invalid strides/sizes")."""
    return torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(out.dtype)


def model_step(model: nn.Module, vocab_size: int, shape: Shape, dtype: str) -> Callable[[], None]:
    """One forward + backward of a language model from tokens to the mean cross-entropy (shared with torchtitan's)."""
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, vocab_size, (shape.batch, shape.seq), generator=g)
    labels = torch.randint(0, vocab_size, (shape.batch, shape.seq), generator=g)

    def step() -> None:
        with compute_dtype(dtype):
            logits = model(tokens)
        F.cross_entropy(logits.float().flatten(0, 1), labels.flatten()).backward()

    return step


def bench_ours(experts: ExpertsFactory, layer: LayerFactory, model: ModelFactory, shapes: list[Shape],
               dtypes: list[str], *, warmup: int, repeats: int) -> list[Row]:
    """Each module is built once and timed in every dtype (autocast changes the compute, not the parameters)."""
    rows = []
    built_model = model() if any(shape.name == "debug" for shape in shapes) else None
    for shape in shapes:
        built_layer = layer(shape)
        for dtype in dtypes:
            rows += bench_experts(experts, shape, dtype, warmup=warmup, repeats=repeats)
            rate, ms = median_tokens_per_s(layer_step(built_layer, shape, dtype), shape.tokens, warmup=warmup,
                                           repeats=repeats)
            rows.append(Row("MoE layer", "torchtitan_lite", shape.name, dtype, rate, ms))
            if built_model is not None and shape.name == "debug":
                rate, ms = median_tokens_per_s(model_step(*built_model, shape, dtype), shape.tokens, warmup=warmup,
                                               repeats=repeats)
                rows.append(Row("qwen3_moe debug model", "torchtitan_lite", shape.name, dtype, rate, ms))
    return rows


def bench_torchtitan(python: str, shapes: list[Shape], dtypes: list[str], *, warmup: int,
                     repeats: int) -> tuple[list[Row], str | None]:
    """torchtitan's rows from its own environment (scripts/_torchtitan_cpu.py moe-bench), or its error text."""
    from torchtitan_lite.tools.repo import SCRIPTS_DIR

    spec = json.dumps({"shapes": [asdict(s) for s in shapes], "dtypes": dtypes, "warmup": warmup, "repeats": repeats})
    result = subprocess.run([python, str(SCRIPTS_DIR / "_torchtitan_cpu.py"), "moe-bench", spec],
                            capture_output=True, text=True)
    if result.returncode != 0:
        return [], (result.stderr or result.stdout).strip()[-3000:]
    rows = json.loads(result.stdout.strip().splitlines()[-1])
    return [Row(**row) for row in rows], None


def machine() -> str:
    """The CPU, its cores and the 1-minute load when the run ended (the host may be shared)."""
    cpu = platform.processor() or platform.machine()
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    return f"{cpu}, {os.cpu_count()} cores, {torch.get_num_threads()} torch threads, load average {load:.2f}"


def markdown(rows: list[Row], shapes: list[Shape], torchtitan_error: str | None, args: argparse.Namespace) -> str:
    lines = [f"moe_experts_bench {datetime.date.today().isoformat()}, torch {torch.__version__}, {machine()}",
             f"median of {args.repeats} forward + backward passes after {args.warmup} warmup, fastest of "
             f"{args.rounds} round(s)",
             *[f"- {s.describe()}" for s in shapes], "",
             "| case | implementation | shape | dtype | tokens/s | ms / step |", "|---|---|---|---|---:|---:|"]
    lines += [f"| {r.case} | {r.impl} | {r.shape} | {r.dtype} | {r.tokens_per_s:,.0f} | {r.ms:.1f} |" for r in rows]
    if torchtitan_error is not None:
        lines += ["", "torchtitan did not run:", "", "```", torchtitan_error, "```"]
    return "\n".join(lines) + "\n"


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="moe_experts_bench.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", nargs="+", choices=list(SHAPES), default=list(SHAPES))
    parser.add_argument("--dtypes", nargs="+", choices=DTYPES, default=list(DTYPES))
    parser.add_argument("--batch", type=int, help="override every shape's batch (a quick run)")
    parser.add_argument("--seq", type=int, help="override every shape's sequence length")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=1, help="time every row this many times, interleaved; "
                        "keep each row's fastest (other work on a shared machine only slows a run down)")
    parser.add_argument("--torchtitan-python", help="the interpreter of an environment with torchtitan 0.3.0 "
                        "(and torch): also time its MoE layer and Qwen3 MoE model on the same shapes")
    parser.add_argument("--out-md", type=Path, help="also write the table here")
    args = parser.parse_args(argv)
    if args.warmup < 0 or args.repeats < 1 or args.rounds < 1:
        parser.error(f"--warmup {args.warmup} must be >= 0, --repeats {args.repeats} and --rounds {args.rounds} >= 1")
    for name in ("batch", "seq"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            parser.error(f"--{name} {getattr(args, name)} must be a positive integer")
    return args


def main(argv: list[str], *, experts: ExpertsFactory, layer: LayerFactory, model: ModelFactory) -> int:
    args = parse_args(argv)
    shapes = [_resized(SHAPES[name], args) for name in args.shapes]
    fastest: dict[tuple[str, str, str, str], Row] = {}
    error = None
    for _ in range(args.rounds):
        torch.manual_seed(0)
        rows = bench_ours(experts, layer, model, shapes, args.dtypes, warmup=args.warmup, repeats=args.repeats)
        if args.torchtitan_python:
            theirs, error = bench_torchtitan(args.torchtitan_python, shapes, args.dtypes, warmup=args.warmup,
                                             repeats=args.repeats)
            rows += theirs
        for row in rows:
            key = (row.case, row.impl, row.shape, row.dtype)
            if key not in fastest or row.tokens_per_s > fastest[key].tokens_per_s:
                fastest[key] = row
    text = markdown(list(fastest.values()), shapes, error, args)
    print(text, end="")
    if args.out_md is not None:
        args.out_md.write_text(text)
    return 0


def _resized(shape: Shape, args: argparse.Namespace) -> Shape:
    changes: dict[str, Any] = {k: v for k, v in (("batch", args.batch), ("seq", args.seq)) if v is not None}
    return Shape(**(asdict(shape) | changes))
