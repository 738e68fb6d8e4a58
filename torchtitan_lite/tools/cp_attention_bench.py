"""Context-parallel attention on CPU: one attention layer with its K/V gather, on 1, 2 and 4 gloo ranks.

    python scripts/cp_attention_bench.py                    # S 8192, cp 1 2 4, GQA and MLA, causal and document
    python scripts/cp_attention_bench.py --seq-len 4096 --cp 1 2 --attention gqa --mask causal

For each case ``cp`` forked processes (gloo, one torch thread each) run the models' own attention layer
(GroupedQueryAttention, or DeepSeek-V3's MultiHeadLatentAttention, each given the group by
``use_context_parallel``) over their head-tail chunks of one sequence of ``--seq-len`` tokens, laid out by
``model_batch`` as the trainer lays it (causal, or documents of random lengths with seed 0). Per rank:

- forward + backward wall time, median of ``--repeats`` after ``--warmup``, between barriers;
- bytes saved for backward by one forward (unique storages through saved_tensors_hooks, parameters excluded);
- the dense mask's bytes ([B, 1, s, S] bool; none under cp=1 causal, which runs SDPA's is_causal);
- communication per layer per step: bytes the all-gather brought from the other ranks and bytes the backward's
  reduce-scatter sent to them, counted from the tensors the collectives really take and return, against the
  formula (cp-1)/cp * S * W * element_size per direction.

A second table computes (no measurement) the same formula for published shapes at long context.
More ranks than cores share the cores: the times per rank are then upper bounds, the bytes are exact.
"""
from __future__ import annotations

import argparse
import datetime
import os
import shlex
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from torchtitan_lite.protocols.model_spec import get_model_spec
from torchtitan_lite.tools.cp_attention_ranks import (
    ATTENTIONS,
    MASKS,
    BuildMask,
    Case,
    RankResult,
    Settings,
    Shapes,
    run_cp,
)


def formula_bytes(seq_len: int, cp: int, width: int, element_size: int) -> int:
    """Bytes one rank receives in one all-gather (and sends in its reduce-scatter): the other ranks' chunks."""
    return (cp - 1) * seq_len * width * element_size // cp


@dataclass(frozen=True)
class Row:
    case: Case
    cp: int
    tokens: int
    """Tokens per rank: S / cp."""
    ms: float
    """The slowest rank's median forward + backward."""
    cpu_share: float
    """Thread CPU time over wall time, mean over ranks (1.0: each rank had a core and never waited)."""
    saved_mib: float
    saved_mask_mib: float
    mask_mib: float
    gather_received: int
    scatter_sent: int
    formula: int
    attention_share: float

    @property
    def matches(self) -> bool:
        return self.gather_received == self.formula and self.scatter_sent == self.formula


def summarize(results: list[RankResult], settings: Settings) -> list[Row]:
    """One row per (case, cp) from its ranks' results; the bytes are the largest over ranks."""
    mib = 1024 ** 2
    element = torch.empty(0, dtype=getattr(torch, settings.dtype)).element_size()
    groups: dict[tuple[Case, int], list[RankResult]] = {}
    for r in results:
        groups.setdefault((r.case, r.cp), []).append(r)
    rows = []
    for (case, cp), ranks in groups.items():
        width = settings.shapes.gathered_width(case.attention)
        rows.append(Row(
            case, cp, settings.seq_len // cp, max(statistics.median(r.step_ms) for r in ranks),
            sum(sum(r.cpu_ms) / sum(r.step_ms) for r in ranks) / len(ranks),
            max(r.saved_bytes for r in ranks) / mib, max(r.saved_mask_bytes for r in ranks) / mib,
            max(r.mask_bytes for r in ranks) / mib, max(r.gather_received for r in ranks),
            max(r.scatter_sent for r in ranks), formula_bytes(settings.seq_len, cp, width, element),
            ranks[0].attention_share))
    return sorted(rows, key=lambda row: (ATTENTIONS.index(row.case.attention), MASKS.index(row.case.mask), row.cp))


def measured_table(rows: list[Row]) -> list[str]:
    lines = ["| attention | mask | cp | tokens / rank | fwd+bwd ms per rank | CPU share | saved for backward MiB "
             "per rank | of it mask-shaped | mask MiB | gather received B | reduce-scatter sent B | formula B | "
             "= formula |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        mask = r.case.mask if r.case.mask == "causal" else f"document ({100 * r.attention_share:.1f}% of causal pairs)"
        lines.append(f"| {r.case.attention.upper()} | {mask} | {r.cp} | {r.tokens} | {r.ms:.0f} | {r.cpu_share:.2f} | "
                     f"{r.saved_mib:.1f} | {r.saved_mask_mib:.1f} | {r.mask_mib:.1f} | {r.gather_received:,} | "
                     f"{r.scatter_sent:,} | {r.formula:,} | {'yes' if r.matches else '**no**'} |")
    return lines


@dataclass(frozen=True)
class Layout:
    """A published model's attention per rank at long context, for the computed table."""

    name: str
    n_layers: int
    kv_heads: int
    head_dim: int
    tp: int
    seq_len: int
    cp: int
    element_size: int = 2  # bfloat16

    @property
    def width(self) -> int:
        return 2 * self.kv_heads // self.tp * self.head_dim


def published_layouts() -> list[Layout]:
    """llama3's 8B and 405B flavors (the registry's: the script imports the families)."""
    flavors = get_model_spec("llama3").flavors

    def layout(flavor: str, name: str, tp: int, cp: int) -> Layout:
        a = flavors[flavor]
        return Layout(name, a.n_layers, a.kv_heads, a.head_dim, tp, 131072, cp)

    return [layout("8B", "llama3_8b", 1, 8), layout("405B", "Llama 3 405B", 8, 16)]


def computed_table(layouts: list[Layout]) -> list[str]:
    gib = 1024 ** 3
    lines = ["| model | layers | kv heads / rank x head_dim (tp) | seq | cp | W | per layer per collective GiB | "
             "per step, no AC (2 per layer) GiB | per step, full AC (3 per layer) GiB |",
             "|---|---:|---|---:|---:|---:|---:|---:|---:|"]
    for lay in layouts:
        one = formula_bytes(lay.seq_len, lay.cp, lay.width, lay.element_size)
        lines.append(f"| {lay.name} | {lay.n_layers} | {lay.kv_heads // lay.tp} x {lay.head_dim} (tp {lay.tp}) | "
                     f"{lay.seq_len} | {lay.cp} | {lay.width} | {one / gib:.3f} | {lay.n_layers * 2 * one / gib:.1f} | "
                     f"{lay.n_layers * 3 * one / gib:.1f} |")
    return lines


def report(settings: Settings, rows: list[Row], *, command: str, cps: list[int], elapsed_s: float,
           load: tuple[float | None, float | None]) -> str:
    from torchtitan_lite.components.device_peaks import cpu_flags
    from torchtitan_lite.tools.benchmark.run_info import cpu_description, git_commit

    flags = cpu_flags()
    kernels = ", ".join(f for f in ("avx512_bf16", "amx_bf16", "amx_tile") if f in flags) or "no avx512_bf16 / AMX"
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    loads = " -> ".join(f"{x:.1f}" if x is not None else "?" for x in load)
    cores = os.cpu_count() or 1
    over = [cp for cp in cps if cp > cores]
    s = settings.shapes
    attentions = sorted({r.case.attention for r in rows}, key=ATTENTIONS.index)
    lines = [
        f"#### One attention layer with its K/V gather: S {settings.seq_len}, batch 1, {settings.dtype}",
        "",
        f"- command: `{command}` ({elapsed_s:.0f} s)",
        f"- device: {cpu_description(1)} per rank, flags {kernels}; torch {torch.__version__}, gloo; {date}; "
        f"commit {git_commit()}; load average {loads}",
        *[f"- {s.describe(a)}" for a in attentions],
        f"- {settings.repeats} timed forward + backward passes after {settings.warmup} warm-up, median; the slowest "
        "rank's. CPU share: thread CPU time over wall time, mean over ranks",
    ]
    if over:
        lines.append(f"- **cp {', '.join(map(str, over))}: more ranks than the {cores} cores** (oversubscribed): "
                     "those times per rank are upper bounds; the bytes are exact")
    lines += ["", *measured_table(rows), "", "Computed, not measured: (cp-1)/cp x S x W x 2 bytes (bf16) per "
              "collective per layer per rank; the gather in forward and the reduce-scatter in backward, plus the "
              "gather again in the recompute under full activation checkpointing.", "",
              *computed_table(published_layouts())]
    return "\n".join(lines) + "\n"


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="cp_attention_bench.py", description=__doc__.splitlines()[0])
    parser.add_argument("--seq-len", type=int, default=8192, help="total sequence length S (default 8192)")
    parser.add_argument("--cp", type=int, nargs="+", default=[1, 2, 4], help="CP degrees (default 1 2 4)")
    parser.add_argument("--attention", nargs="+", choices=ATTENTIONS, default=list(ATTENTIONS))
    parser.add_argument("--mask", nargs="+", choices=MASKS, default=list(MASKS))
    parser.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out-md", type=Path, help="write the markdown section here")
    parser.add_argument("--append", action="store_true", help="append to --out-md instead of overwriting it")
    args = parser.parse_args(argv)
    if args.warmup < 0 or args.repeats < 1 or any(cp < 1 for cp in args.cp):
        parser.error("--cp and --repeats must be >= 1 and --warmup >= 0")
    bad = [cp for cp in args.cp if args.seq_len % (2 * cp)]
    if bad:
        parser.error(f"--seq-len {args.seq_len} must split into 2 x cp chunks (cp {bad})")
    return args


def measure(settings: Settings, cps: list[int], cases: list[Case], build_mask: BuildMask) -> list[Row]:
    results: list[RankResult] = []
    for cp in cps:
        results += run_cp(cp, cases, settings, build_mask)
        print(f"cp={cp}: done", flush=True)
    return summarize(results, settings)


def main(argv: list[str], *, build_mask: BuildMask) -> int:
    """``build_mask``: models/common/attention/mask.py's, which the model's forward builds its mask with."""
    from torchtitan_lite.tools.benchmark.report import write_markdown

    args = parse_args(argv)
    settings = Settings(args.seq_len, args.dtype, args.warmup, args.repeats, Shapes())
    cases = [Case(a, m) for a in args.attention for m in args.mask]
    load_before = _load()
    start = time.monotonic()
    rows = measure(settings, args.cp, cases, build_mask)
    command = "python scripts/cp_attention_bench.py " + shlex.join(argv)
    section = report(settings, rows, command=command.strip(), cps=args.cp, elapsed_s=time.monotonic() - start,
                     load=(load_before, _load()))
    print(section)
    if args.out_md:
        write_markdown(args.out_md, section, append=args.append)
    return 0 if all(r.matches for r in rows) else 1


def _load() -> float | None:
    from torchtitan_lite.tools.benchmark.run_info import load_average

    return load_average()
