"""Causal attention forward + backward at one model's shapes, per kernel choice, on this machine.

    python scripts/attention_bench.py                      # llama3_debug's shapes, bfloat16 activations
    python scripts/attention_bench.py --dtype float32 --batch 1 --seq 8192 --heads 32 --kv-heads 8 --head-dim 128

The rows are the choices a trainer has for reduced-precision attention on a CPU:

- ``sdpa``: torch's SDPA in the activations' dtype (its flash kernel on CPU);
- ``sdpa in float32``: the model family's attention (``model_attention``; Llama's
  ``models/common/attention/grouped_query.py`` widens bf16 / fp16 inputs on a CPU and rounds the output once);
- ``softmax(QK^T)V``: the plain formula with the scores in the activations' dtype and the softmax in
  float32, eager and compiled (inductor fuses the mask, scale and softmax; the matmuls stay oneDNN's).

Each row times ``--repeats`` forward + backward passes after ``--warmup`` ones, fastest of ``--rounds``.
The error column is the output's largest difference from a float64 reference of the same inputs,
relative to the reference's largest magnitude: the price of rounding the scores.
"""
from __future__ import annotations

import argparse
import datetime
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

Attention = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class Shapes:
    batch: int
    seq: int
    heads: int
    kv_heads: int
    head_dim: int

    def describe(self) -> str:
        return (f"batch {self.batch} x {self.heads} heads ({self.kv_heads} KV heads) x seq {self.seq} x head_dim "
                f"{self.head_dim}")


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=k.shape[1] != q.shape[1])


def softmax_qk_v(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    n_rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(n_rep, dim=1), v.repeat_interleave(n_rep, dim=1)
    scores = (q @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5
    seq = q.shape[2]
    mask = torch.ones(seq, seq, dtype=torch.bool, device=q.device).tril()
    probs = torch.softmax(scores.float().masked_fill(~mask, float("-inf")), dim=-1)
    return probs.to(q.dtype) @ v


def variants(model_attention: Attention) -> dict[str, Attention]:
    return {
        "sdpa": sdpa,
        "sdpa in float32 (the model's CPU path)": model_attention,
        "softmax(QK^T)V": softmax_qk_v,
        "softmax(QK^T)V, compiled": torch.compile(softmax_qk_v, fullgraph=True),
    }


def inputs(shapes: Shapes, dtype: torch.dtype, seed: int = 0) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    s = shapes
    q = torch.randn(s.batch, s.heads, s.seq, s.head_dim, generator=g)
    k = torch.randn(s.batch, s.kv_heads, s.seq, s.head_dim, generator=g)
    v = torch.randn(s.batch, s.kv_heads, s.seq, s.head_dim, generator=g)
    grad = torch.randn(s.batch, s.heads, s.seq, s.head_dim, generator=g)
    return tuple(t.to(dtype) for t in (q, k, v, grad))


def relative_error(fn: Attention, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> float:
    reference = softmax_qk_v(q.double(), k.double(), v.double())
    with torch.no_grad():
        out = fn(q, k, v).double()
    return float((out - reference).abs().max() / reference.abs().max())


def time_ms(fn: Attention, tensors: tuple[torch.Tensor, ...], *, warmup: int, repeats: int, rounds: int) -> float:
    q, k, v, grad = (t.clone().requires_grad_(i < 3) for i, t in enumerate(tensors))
    for _ in range(warmup):
        fn(q, k, v).backward(grad)
    best = float("inf")
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(repeats):
            fn(q, k, v).backward(grad)
        best = min(best, (time.perf_counter() - start) / repeats * 1e3)
    return best


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default="bfloat16",
                        help="the activations' dtype (default bfloat16)")
    parser.add_argument("--batch", type=int, default=16, help="default 16 (llama3_debug)")
    parser.add_argument("--seq", type=int, default=128, help="default 128 (llama3_debug)")
    parser.add_argument("--heads", type=int, default=8, help="query heads, default 8 (llama3_debug)")
    parser.add_argument("--kv-heads", type=int, default=4, help="key / value heads, default 4 (llama3_debug)")
    parser.add_argument("--head-dim", type=int, default=32, help="default 32 (llama3_debug)")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=2, help="timed rounds per row; the fastest is kept")
    parser.add_argument("--out-md", type=Path, help="write the markdown section here")
    parser.add_argument("--append", action="store_true", help="append to --out-md instead of overwriting it")
    args = parser.parse_args(argv)
    if any(n < 1 for n in (args.batch, args.seq, args.heads, args.kv_heads, args.head_dim, args.repeats,
                           args.rounds)) or args.warmup < 0:
        parser.error("sizes, --repeats and --rounds must be >= 1 and --warmup >= 0")
    if args.heads % args.kv_heads:
        parser.error(f"--heads {args.heads} must be a multiple of --kv-heads {args.kv_heads}")
    return args


def report(args: argparse.Namespace, shapes: Shapes, rows: list[tuple[str, float, float]]) -> str:
    from torchtitan_lite.tools.benchmark.run_info import cpu_description, git_commit, load_average

    bf16 = "with" if torch.ops.mkldnn._is_mkldnn_bf16_supported() else "without"
    load = load_average()
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    lines = [
        f"#### Causal attention, forward + backward: {shapes.describe()}, {args.dtype} activations",
        "",
        f"- device: {cpu_description(torch.get_num_threads())}, {bf16} oneDNN bfloat16 kernels; torch "
        f"{torch.__version__}; {date}; commit {git_commit()}" + (f"; load average {load:.1f}" if load is not None
                                                                  else ""),
        f"- {args.repeats} passes after {args.warmup} warm-up ones, fastest of {args.rounds} rounds; error: largest "
        "output difference from a float64 reference, relative to its largest magnitude",
        "",
        "| attention | ms per forward + backward | relative error |",
        "|---|---:|---:|",
    ]
    lines += [f"| {name} | {ms:.2f} | {err:.1e} |" for name, ms, err in rows]
    return "\n".join(lines) + "\n"


def main(argv: list[str], *, model_attention: Attention) -> int:
    """``model_attention(q, k, v)``: causal attention of [batch, heads, seq, head_dim] tensors as the model runs it."""
    from torchtitan_lite.tools.benchmark.report import write_markdown

    args = parse_args(argv)
    shapes = Shapes(args.batch, args.seq, args.heads, args.kv_heads, args.head_dim)
    dtype = getattr(torch, args.dtype)
    tensors = inputs(shapes, dtype)
    rows = []
    for name, fn in variants(model_attention).items():
        ms = time_ms(fn, tensors, warmup=args.warmup, repeats=args.repeats, rounds=args.rounds)
        rows.append((name, ms, relative_error(fn, *tensors[:3])))
        print(f"{name}: {ms:.2f} ms", flush=True)
    section = report(args, shapes, rows)
    print(section)
    if args.out_md:
        write_markdown(args.out_md, section, append=args.append)
    return 0
