"""Pipeline bubble of each schedule on CPU ranks joined by gloo: the idle share of a step against the theory.

    python scripts/pipeline_bubble.py                        # 2 and 4 ranks, every schedule, llama3 debug width
    python scripts/pipeline_bubble.py --pp 2 --schedules 1F1B Interleaved1F1B --steps 3

For each pipeline size it starts that many processes (one torch thread each, gloo), and for each schedule
builds the stages as the trainer does (``resolve_pipeline`` -> ``build_stage_modules`` -> ``PipelineRunner``)
from a model whose stages are equal: the blocks are split evenly with explicit split points and the
vocabulary is small, so the embedding and the head add little to the first and last stage. Each step runs
between two barriers; a rank's compute is the wall time inside its stages' ``forward_one_chunk``,
``backward_one_chunk`` and ``backward_weight_one_chunk`` and the loss function (on CUDA the GPU time between
events around those calls); everything else in the step
(waiting for a neighbour's activations or gradients, send/receive, the schedule's bookkeeping, the closing
barrier) is idle. The idle share of a rank is ``1 - compute / step``, summed over the measured steps.

Theory (equal stages, free communication; ``p`` ranks, ``m`` micro-batches, ``v`` stages per rank):

- 1F1B: ``(p-1) / (m+p-1)``. Each rank idles ``p-1`` forward+backward slots of the ``m+p-1`` the step lasts
  (Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU Clusters Using
  Megatron-LM", Sec. 2.2: bubble time fraction ``(p-1)/m`` of the ideal time).
- Interleaved1F1B: ``(p-1) / (v*m + p-1)``: the same ``p-1`` slots, each ``v`` times shorter (ibid., Sec.
  2.2.2: bubble time fraction ``(1/v)(p-1)/m``).
- ZBVZeroBubble: ``0`` when forward, input-backward and weight-backward of a chunk take the same time
  and ``m >= 2p`` (Qi et al. 2024, "Zero Bubble (Almost) Pipeline Parallelism", ZB-V schedule); real F, B
  and W differ (the measured chunk times are printed beside it).
- DualPipeV: bubble time ``(PP/2-1)(F&B + B - 3W)`` with ``PP = 2p`` stages (DeepSeek-V3 technical report,
  Table 2; the DualPipe repository's table gives the same for DualPipeV), F a chunk's forward, B its full
  backward, W its weight backward, F&B an overlapped forward and backward, which torch runs one after the
  other (``F&B = F + B``). Evaluated with the measured chunk times; the share is the bubble over the bubble
  plus the rank's ``2m`` chunks of compute.

With more ranks than cores the ranks share cores: a rank that is ready to compute may wait for a core, and
that wait lands in its compute time (wall clock) or in another rank's idle time. The report states the core
count and the compute time's CPU share (thread CPU time / wall time inside compute), which drops below 1
when the rank was descheduled while computing.
"""
# The docstring above is also --help. This module holds the report and the command line; the ranks that
# measure are in pipeline_bubble_ranks.py, the formulas in pipeline_bubble_theory.py.
from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import torch

from torchtitan_lite.components.device_peaks import CPU_BF16_FLAGS, cpu_flags, cpu_model_name
from torchtitan_lite.distributed.pipeline import SCHEDULES
from torchtitan_lite.tools.benchmark.run_info import git_commit, load_average
from torchtitan_lite.tools.pipeline_bubble_ranks import RankResult, Settings, chunk_means, layout_for, run_pipeline
from torchtitan_lite.tools.pipeline_bubble_theory import equal_split_points, idle_share, theory_idle_share


@dataclass(frozen=True)
class Row:
    pp: int
    schedule: str
    stages_per_rank: int
    n_microbatches: int
    step_ms: float
    idle: list[float]
    """Per rank."""
    theory: float | None
    chunk_ms: dict[str, float]
    cpu_share: float | None
    """Thread CPU time over wall time inside compute (None on CUDA, where compute is GPU time)."""


def summarize(results: list[RankResult], settings: Settings) -> list[Row]:
    rows = []
    groups: dict[tuple[int, str], list[RankResult]] = defaultdict(list)
    for r in results:
        groups[(r.pp, r.schedule)].append(r)
    for (pp, schedule), ranks in groups.items():
        layout = layout_for(schedule, pp, settings)
        chunks = chunk_means(ranks)
        theory = theory_idle_share(schedule, pp=pp, n_microbatches=layout.n_microbatches,
                                   stages_per_rank=layout.stages_per_rank, chunk_s=chunks)
        rows.append(Row(pp, schedule, layout.stages_per_rank, layout.n_microbatches,
                        1000 * max(r.step_s for r in ranks) / settings.steps,
                        [idle_share(r.step_s, r.compute_s) for r in ranks], theory,
                        {k: 1000 * v for k, v in chunks.items()},
                        None if any(r.gpu for r in ranks) else
                        sum(r.compute_cpu_s for r in ranks) / sum(r.compute_s for r in ranks)))
    return rows


def markdown(rows: list[Row]) -> list[str]:
    lines = ["| ranks | schedule | stages/rank | micro-batches | step ms | idle share per rank | mean | theory | "
             "chunk ms F / B / I / W | compute CPU share |",
             "|---:|---|---:|---:|---:|---|---:|---:|---|---:|"]
    for row in rows:
        chunk = " / ".join(f"{row.chunk_ms[k]:.1f}" if k in row.chunk_ms else "-"
                           for k in ("forward", "backward", "backward_input", "backward_weight"))
        theory = "n/a" if row.theory is None else f"{row.theory:.1%}"
        lines.append(f"| {row.pp} | {row.schedule} | {row.stages_per_rank} | {row.n_microbatches} | {row.step_ms:.0f} | "
                     f"{', '.join(f'{x:.1%}' for x in row.idle)} | {sum(row.idle) / len(row.idle):.1%} | {theory} | "
                     f"{chunk} | {'-' if row.cpu_share is None else f'{row.cpu_share:.2f}'} |")
    return lines


def environment(pps: list[int], results: list[RankResult], command: str,
                loads: tuple[float | None, float | None]) -> list[str]:
    flags = cpu_flags()
    bf16 = ", ".join(f for f in CPU_BF16_FLAGS if f in flags) or "no avx512_bf16 / amx_bf16"
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    load = " -> ".join("n/a" if x is None else f"{x:.2f}" for x in loads)
    gpus = sorted({r.gpu for r in results if r.gpu})
    if gpus:
        device = f"- GPUs: {', '.join(gpus)}, one per rank (NCCL); host CPU {cpu_model_name()}"
    else:
        over = [p for p in pps if cores is not None and p > cores]
        device = (f"- CPU: {cpu_model_name()} ({bf16}), {cores} cores usable; one torch thread per rank"
                  + (f"; {', '.join(map(str, over))} ranks share {cores} cores (oversubscribed)" if over else ""))
    return [device,
            f"- torch {torch.__version__}, gloo; commit {git_commit()}; "
            f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC; 1-minute load average {load} "
            f"(before -> after)",
            f"- command: `{command}`"]


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, Settings]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog=__doc__.split("\n\n", 1)[1])
    defaults = Settings()
    parser.add_argument("--pp", type=int, nargs="+", default=[2, 4], help="pipeline sizes (ranks), default 2 4")
    parser.add_argument("--schedules", nargs="+", default=list(SCHEDULES), choices=list(SCHEDULES))
    for name in ("n_layers", "vocab_size", "seq_len", "microbatch_size", "n_microbatches", "warmup", "steps"):
        parser.add_argument(f"--{name.replace('_', '-')}", type=int, default=getattr(defaults, name))
    parser.add_argument("--device", choices=("cpu", "cuda"), default=defaults.device,
                        help="cpu: gloo ranks with one torch thread each; cuda: NCCL ranks, one GPU each")
    parser.add_argument("--model", default=defaults.model)
    parser.add_argument("--flavor", default=defaults.flavor)
    parser.add_argument("--out-md", type=Path, default=None, help="also write the markdown section here")
    parser.add_argument("--json-out", type=Path, default=None, help="also write every rank's timings here")
    args = parser.parse_args(argv)
    settings = Settings(**{f.name: getattr(args, f.name) for f in dataclasses.fields(Settings)})
    for pp in args.pp:
        if pp < 2:
            parser.error(f"--pp {pp}: a pipeline needs at least 2 ranks")
        for schedule in args.schedules:
            try:
                layout_for(schedule, pp, settings)
            except ValueError as err:
                parser.error(f"--pp {pp} --schedules {schedule}: {err}")
    if settings.steps < 1:
        parser.error("--steps must be at least 1")
    return args, settings


def main(argv: list[str], command: str = "python scripts/pipeline_bubble.py") -> int:
    args, settings = parse_args(argv)
    load_before = load_average()
    start = time.perf_counter()
    results: list[RankResult] = []
    for pp in args.pp:
        print(f"pp={pp}: {', '.join(args.schedules)} ...", flush=True)
        results += run_pipeline(pp, args.schedules, settings)
    rows = summarize(results, settings)
    lines = [f"Pipeline bubble, {settings.describe()}", "",
             *environment(args.pp, results, " ".join([command, *argv]), (load_before, load_average())),
             f"- run time {time.perf_counter() - start:.0f} s", "", *markdown(rows)]
    text = "\n".join(lines) + "\n"
    print(text, end="")
    if args.out_md:
        args.out_md.write_text(text)
    if args.json_out:
        args.json_out.write_text(json.dumps([dataclasses.asdict(r) for r in results], indent=1) + "\n")
    return 0


# The report's own names and, for the code that reads them from here, the measured and analytic sides'.
__all__ = ["SCHEDULES", "RankResult", "Row", "Settings", "chunk_means", "environment", "equal_split_points",
           "idle_share", "layout_for", "main", "markdown", "parse_args", "run_pipeline", "summarize",
           "theory_idle_share"]
