"""Forward + backward time of one Linear in high precision vs each FP8 recipe; prints a speedup table.

    python scripts/float8_layer_bench.py --shapes llama3_8b                 # the 8B Linears at 8192 tokens
    python scripts/float8_layer_bench.py --shapes llama3_70b --tokens 16384
    python scripts/float8_layer_bench.py --shapes 8192,4096,14336 16384,8192,8192
    python scripts/float8_layer_bench.py --shapes 256,256,256 --no-compile   # a quick CPU check
    python scripts/float8_layer_bench.py --shapes llama3_8b --recipes tensorwise blockwise

A shape M,K,N is a Linear with K inputs and N outputs applied to M tokens (local batch x sequence).
A preset ``llama3_<flavor>`` takes every distinct Linear of one transformer block plus the output
head from the model's flavor table, at M = ``--tokens``. Each variant (the ``--dtype`` Linear, then
torchao ``Float8Linear`` per recipe) is wrapped in ``torch.compile`` unless ``--no-compile``, warmed
up, and timed over ``--iters`` forward+backward passes with a fixed upstream gradient (CUDA events
on a GPU, a synchronised wall clock on CPU). Speedup = high-precision time / FP8 time, so > 1 means
FP8 is faster. FP8 pays off only on large GEMMs with compile on FP8 tensor cores (sm_89+); a CPU
has no FP8 matrix units, so there the table only shows that the code runs.

``blockwise`` (not timed unless named in ``--recipes``) is the float8_blockwise converter's Linear
(DeepSeek-V3: 1x128 activation / gradient tiles, 128x128 weight blocks, float32 scales), run eagerly:
on an sm_90 GPU its native path is torchao's Triton quantization kernels and cuBLAS's blockwise GEMM,
which need no compile; anywhere else it is emulated, which the header says (those times are not the
kernels'). Its shapes need K and N multiples of 128.
"""
from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import torch
import torch.nn as nn

DEFAULT_RECIPES = ("tensorwise", "rowwise", "rowwise_with_gw_hp")
"""torchao Float8Linear recipes, timed by default."""
BLOCKWISE = "blockwise"
RECIPES = (*DEFAULT_RECIPES, BLOCKWISE)
DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}
DEFAULT_TOKENS = 8192
PRESET_PREFIX = "llama3_"


@dataclass(frozen=True)
class Shape:
    name: str
    m: int
    k: int
    n: int
    count: int = 1
    """Linears of this shape in the model part the shapes describe (a preset times each distinct shape
    once; the sum row counts it this often)."""

    @property
    def train_flops(self) -> int:
        """Forward (1 GEMM) + backward (2 GEMMs) matmul FLOPs."""
        return 3 * 2 * self.m * self.k * self.n


# --------------------------------------------------------------------------------------------------
# Shapes


def preset_shapes(preset: str, tokens: int) -> list[Shape]:
    """The distinct Linear shapes of block 0 plus the output head of the llama3 flavor named by ``preset``
    (the llama3 family must be registered: the script imports ``models``). Linears of one shape (wq and wo,
    wk and wv, w1 and w3) are timed once under their joined names, counted as often as they occur."""
    from torchtitan_lite.protocols.model_spec import build_model_args, get_model_spec

    spec = get_model_spec("llama3")
    flavors = {f"{PRESET_PREFIX}{flavor.lower()}": flavor for flavor in spec.flavors}
    if preset not in flavors:
        raise ValueError(f"unknown shape preset {preset!r}; use M,K,N or one of: {', '.join(flavors)}")
    # Every block has the same shapes: one block plus the head describes the model.
    args = build_model_args(spec, flavors[preset], n_layers=1)
    with torch.device("meta"):
        model = spec.model_cls(args)
    names: dict[tuple[int, int], list[str]] = {}
    blocks = spec.parallel_plan.blocks
    for fqn, module in model.named_modules():
        if isinstance(module, nn.Linear) and (fqn.startswith(f"{blocks}.0.") or f"{blocks}." not in fqn):
            names.setdefault((module.in_features, module.out_features), []).append(fqn.split(".")[-1])
    return [Shape(", ".join(group), tokens, k, n, count=len(group)) for (k, n), group in names.items()]


def parse_shapes(specs: list[str], tokens: int) -> list[Shape]:
    """Shapes from M,K,N triples and llama3_<flavor> presets, in the order given."""
    shapes = []
    for spec in specs:
        if spec.startswith(PRESET_PREFIX):
            shapes += preset_shapes(spec, tokens)
            continue
        parts = spec.split(",")
        if len(parts) != 3 or not all(p.strip().isdigit() and int(p) > 0 for p in parts):
            raise ValueError(f"shape {spec!r} is not M,K,N with positive integers (e.g. 8192,4096,14336) or a "
                             f"preset such as llama3_8b")
        m, k, n = (int(p) for p in parts)
        shapes.append(Shape(f"{m}x{k}x{n}", m, k, n))
    return shapes


# --------------------------------------------------------------------------------------------------
# Timing


def make_variant(recipe: str | None, k: int, n: int, dtype: torch.dtype, device: torch.device, *,
                 compile: bool, tokens: int = DEFAULT_TOKENS) -> nn.Module:
    """A bias-free Linear(k, n) in ``dtype``, converted to Float8Linear with ``recipe`` when given (blockwise:
    BlockwiseFP8Linear, never compiled; see the module docstring)."""
    from torchao.float8 import Float8LinearConfig
    from torchao.float8.float8_linear import Float8Linear

    from torchtitan_lite.compat import float8_recipe_needs_emulation

    torch.manual_seed(0)
    module: nn.Module = nn.Linear(k, n, bias=False, device=device, dtype=dtype)
    if recipe == BLOCKWISE:
        from torchtitan_lite.components.quantization.blockwise_linear import blockwise_linear_from

        emulate = blockwise_kernel(device, dtype, tokens).emulate is not False
        return blockwise_linear_from(cast(nn.Linear, module), emulate=emulate, power_of_2=False)
    if recipe is not None:
        # A torch whose CPU _scaled_mm lacks rowwise scales emulates them (the CPU table only shows the code runs).
        emulate = float8_recipe_needs_emulation(recipe, device.type) is not None
        config = dataclasses.replace(Float8LinearConfig.from_recipe_name(recipe), emulate=emulate)
        module = Float8Linear.from_float(copy.deepcopy(module), config=config)
    return cast(nn.Module, torch.compile(module)) if compile else module  # compiling a Module gives a Module


def blockwise_kernel(device: torch.device, dtype: torch.dtype, tokens: int) -> Any:
    """The float8_blockwise converter's kernel decision (kernel='auto', float32 scales) for this device."""
    from torchtitan_lite.components.quantization.float8_blockwise import (
        decide_blockwise_kernel,
        native_kernels_missing,
    )

    on_gpu = device.type == "cuda"
    return decide_blockwise_kernel(
        "auto", device_type=device.type, capability=torch.cuda.get_device_capability(device) if on_gpu else None,
        device_name=torch.cuda.get_device_name(device) if on_gpu else "the GPU", param_dtype=dtype,
        power_of_2=False, seq_len=tokens, missing=native_kernels_missing() if on_gpu else "")


def check_blockwise_shapes(shapes: list[Shape]) -> None:
    """ValueError naming the shapes whose K or N is not a multiple of 128 (the blockwise tile)."""
    from torchtitan_lite.components.quantization.blockwise_fp8 import BLOCK

    bad = [f"{s.name} ({s.k} x {s.n})" for s in shapes if s.k % BLOCK or s.n % BLOCK]
    if bad:
        raise ValueError(f"--recipes {BLOCKWISE} needs K and N multiples of {BLOCK} (128x128 weight blocks); not: "
                         f"{', '.join(bad)}. Drop those shapes or the recipe")


def time_fwd_bwd(module: nn.Module, x: torch.Tensor, grad_out: torch.Tensor, *, warmup: int, iters: int) -> float:
    """Median seconds of ``module(x).backward(grad_out)`` over ``iters`` runs after ``warmup`` runs."""

    def step() -> None:
        module(x).backward(grad_out)
        x.grad = None
        module.zero_grad(set_to_none=True)

    for _ in range(warmup):
        step()
    timer = _cuda_timer if x.device.type == "cuda" else _wall_timer
    return statistics.median(timer(step) for _ in range(iters))


def _cuda_timer(fn: Callable[[], None]) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3


def _wall_timer(fn: Callable[[], None]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def time_variants(shape: Shape, recipes: list[str | None], dtype: torch.dtype, device: torch.device, *,
                  compile: bool, warmup: int, iters: int) -> dict[str, tuple[float, float]]:
    """Per variant (key 'hp' for the ``dtype`` Linear, else the recipe): (median seconds per forward+backward,
    seconds of its warm-up, which holds compilation and kernel autotuning)."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(shape.m, shape.k, generator=gen).to(device, dtype).requires_grad_()
    grad_out = torch.randn(shape.m, shape.n, generator=gen).to(device, dtype)
    times = {}
    for recipe in recipes:
        module = make_variant(recipe, shape.k, shape.n, dtype, device, compile=compile, tokens=shape.m)
        start = time.perf_counter()
        median = time_fwd_bwd(module, x, grad_out, warmup=warmup, iters=iters)
        times[recipe or "hp"] = (median, time.perf_counter() - start - median * iters)
        del module
        if compile:
            torch._dynamo.reset()  # each variant compiles afresh; no recompile-limit surprises across shapes
    return times


def progress_line(shape: Shape, times: dict[str, tuple[float, float]], dtype_name: str, hp: float) -> str:
    """One measured shape (speedups over ``hp``, the high-precision median), printed as soon as it is done, so
    that a run cut short keeps what it measured."""
    parts = []
    for key, (median, warm) in times.items():
        label = dtype_name if key == "hp" else key
        speedup = "" if key == "hp" else f", {hp / median:.2f}x"
        parts.append(f"{label} {median * 1e3:.3f} ms{speedup} (warm-up {warm:.1f} s)")
    dims = f"{shape.m}x{shape.k}x{shape.n}"
    return f"measured {shape.name if shape.name == dims else f'{shape.name} ({dims})'}: " + "; ".join(parts)


# --------------------------------------------------------------------------------------------------
# Report


def format_table(rows: list[tuple[Shape, dict[str, float]]], recipes: list[str], dtype_name: str) -> str:
    """Markdown table: milliseconds and speedup over the high-precision Linear per recipe, plus a sum row over
    every Linear (a shape counted ``count`` times)."""
    header = ["layer", "M", "K", "N", f"{dtype_name} ms", f"{dtype_name} TFLOP/s"]
    for recipe in recipes:
        header += [f"{recipe} ms", f"{recipe} speedup"]
    lines = ["| " + " | ".join(header) + " |", "|---|" + "---:|" * (len(header) - 1)]
    for shape, times in rows:
        hp = times["hp"]
        cells = [shape.name, str(shape.m), str(shape.k), str(shape.n), f"{hp * 1e3:.3f}",
                 f"{shape.train_flops / hp / 1e12:.3g}"]
        for recipe in recipes:
            cells += [f"{times[recipe] * 1e3:.3f}", f"{hp / times[recipe]:.2f}x"]
        lines.append("| " + " | ".join(cells) + " |")
    if len(rows) > 1 or rows[0][0].count > 1:
        total_hp = sum(t["hp"] * shape.count for shape, t in rows)
        cells = ["all (sum)", "", "", "", f"{total_hp * 1e3:.3f}", ""]
        for recipe in recipes:
            total = sum(t[recipe] * shape.count for shape, t in rows)
            cells += [f"{total * 1e3:.3f}", f"{total_hp / total:.2f}x"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def write_json(path: Path, shapes: list[Shape], measured: list[dict[str, tuple[float, float]]], *, device: str,
               dtype: str) -> None:
    """The shapes measured so far with their median seconds per variant (see ``--json-out``)."""
    rows = [{"name": s.name, "m": s.m, "k": s.k, "n": s.n, "count": s.count,
             "seconds": {key: median for key, (median, _) in times.items()}}
            for s, times in zip(shapes, measured) if times]
    path.write_text(json.dumps({"device": device, "dtype": dtype, "rows": rows}, indent=2) + "\n")


def describe_device(device: torch.device) -> str:
    """GPU name with its compute capability, or the CPU thread count."""
    if device.type == "cuda":
        return f"{torch.cuda.get_device_name(device)} (sm_{''.join(map(str, torch.cuda.get_device_capability(device)))})"
    return f"CPU ({torch.get_num_threads()} threads)"


def check_fp8_support(device: torch.device) -> None:
    """Raise ValueError on a GPU without FP8 tensor cores, where the timings would mean nothing."""
    from torchtitan_lite.components.quantization.float8 import MIN_FP8_CAPABILITY

    if device.type == "cuda" and torch.cuda.get_device_capability(device) < MIN_FP8_CAPABILITY:
        raise ValueError(f"{torch.cuda.get_device_name(device)} has no FP8 tensor cores (needs compute capability "
                         f"{MIN_FP8_CAPABILITY[0]}.{MIN_FP8_CAPABILITY[1]}+): FP8 timings would be meaningless; "
                         f"run on an H100/H200/L40S-class GPU")


# --------------------------------------------------------------------------------------------------


def parse_args(argv: list[str]) -> argparse.Namespace:
    """The command line, checked."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument("--shapes", nargs="+", default=["llama3_8b"], metavar="SHAPE",
                        help="M,K,N triples and/or presets llama3_<flavor> (default: llama3_8b)")
    parser.add_argument("--tokens", type=int, default=DEFAULT_TOKENS,
                        help="M (tokens = local batch x sequence) for presets")
    parser.add_argument("--recipes", nargs="+", default=list(DEFAULT_RECIPES), choices=RECIPES,
                        help=f"FP8 recipes to time (default: {' '.join(DEFAULT_RECIPES)}; {BLOCKWISE} on request)")
    parser.add_argument("--dtype", default="bfloat16", choices=list(DTYPES),
                        help="dtype of the high-precision baseline and of the FP8 Linears' inputs/weights")
    parser.add_argument("--no-compile", action="store_true", help="time eager modules (FP8 is slow without compile)")
    parser.add_argument("--warmup", type=int, default=5, help="untimed iterations first (compilation happens here)")
    parser.add_argument("--iters", type=int, default=20, help="timed iterations; the median is reported")
    parser.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    parser.add_argument("--json-out", type=Path, default=None,
                        help="also write every measured shape here, rewritten after each one (so a run cut short "
                             "keeps what it measured): name, m, k, n, count and seconds per variant ('hp' = the "
                             "--dtype Linear)")
    args = parser.parse_args(argv)
    for name in ("tokens", "iters"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be >= 1, got {getattr(args, name)}")
    if args.warmup < 0:
        parser.error(f"--warmup must be >= 0, got {args.warmup}")
    return args


def main(argv: list[str]) -> int:
    """Time every shape of ``argv``'s ``--shapes`` and print the speedup table; 2 on bad input."""
    args = parse_args(argv)
    from torchtitan_lite.library_notices import silence_known_library_notices

    silence_known_library_notices()
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = DTYPES[args.dtype]
    try:
        shapes = parse_shapes(args.shapes, args.tokens)
        check_fp8_support(device)
        if BLOCKWISE in args.recipes:
            check_blockwise_shapes(shapes)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    import torchao

    compiled = "eager (no compile)" if args.no_compile else "torch.compile"
    print(f"float8 Linear forward+backward on {describe_device(device)}, {compiled}, {args.dtype} baseline; "
          f"torch {torch.__version__}, torchao {torchao.__version__}; median of {args.iters} after {args.warmup} "
          f"warm-up iterations", flush=True)
    if BLOCKWISE in args.recipes:
        decision = blockwise_kernel(device, dtype, shapes[0].m)
        how = "eager" if decision.emulate is False else "eager; NOT the kernels' speed"
        print(f"{BLOCKWISE}: {decision.why} ({how})", flush=True)
    print(flush=True)
    measured: list[dict[str, tuple[float, float]]] = [{} for _ in shapes]
    # torchao's recipes for every shape first, blockwise last: its first call per shape autotunes torchao's
    # Triton quantization kernels (~100 s for one shape, measured on an H200), and a run cut short should
    # still hold the other recipes' rows.
    phases: list[list[str | None]] = [[None, *(r for r in args.recipes if r != BLOCKWISE)],
                                      [BLOCKWISE] if BLOCKWISE in args.recipes else []]
    for recipes in filter(None, phases):
        for shape, times in zip(shapes, measured):
            timed = time_variants(shape, recipes, dtype, device, compile=not args.no_compile, warmup=args.warmup,
                                  iters=args.iters)
            times.update(timed)
            print(progress_line(shape, timed, args.dtype, times["hp"][0]), flush=True)
            if args.json_out is not None:
                write_json(args.json_out, shapes, measured, device=describe_device(device), dtype=args.dtype)
    print()
    rows = [(shape, {key: median for key, (median, _) in times.items()}) for shape, times in zip(shapes, measured)]
    print(format_table(rows, args.recipes, args.dtype))
    return 0

