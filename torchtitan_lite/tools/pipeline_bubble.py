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
from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import multiprocessing
import os
import socket
import time
import traceback
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from torchtitan_lite.components.device_peaks import CPU_BF16_FLAGS, cpu_flags, cpu_model_name
from torchtitan_lite.components.loss import cross_entropy_sum
from torchtitan_lite.distributed.pipeline import SCHEDULES, build_stage_modules, resolve_pipeline
from torchtitan_lite.distributed.pipeline.layout import PipelineLayout
from torchtitan_lite.distributed.pipeline.runner import PipelineRunner
from torchtitan_lite.protocols.model_spec import get_model_spec
from torchtitan_lite.tools.benchmark.run_info import git_commit, load_average

KINDS = ("forward", "backward", "backward_input", "backward_weight", "loss")
"""What a rank's compute is made of: full backward (1F1B, interleaved) or input and weight backward apart
(ZBV, DualPipeV)."""


@dataclass(frozen=True)
class Settings:
    model: str = "llama3"
    flavor: str = "debug"
    n_layers: int = 8
    vocab_size: int = 256
    seq_len: int = 128
    microbatch_size: int = 2
    n_microbatches: int = 8
    warmup: int = 2
    steps: int = 5
    device: str = "cpu"
    """'cpu' (gloo, one torch thread per rank) or 'cuda' (NCCL, one GPU per rank)."""

    def describe(self) -> str:
        return (f"{self.model} {self.flavor} width, {self.n_layers} blocks, vocabulary {self.vocab_size}, "
                f"{self.n_microbatches} micro-batches of {self.microbatch_size} x {self.seq_len} tokens; "
                f"{self.warmup} warm-up + {self.steps} measured steps, float32 on {self.device}")


@dataclass
class RankResult:
    pp: int
    schedule: str
    rank: int
    stage_ids: tuple[int, ...]
    step_s: float
    """Wall time of the measured steps, summed."""
    compute_s: float
    compute_cpu_s: float
    """Thread CPU time inside compute, summed (below compute_s when the rank waited for a core)."""
    kind_s: dict[str, float] = field(default_factory=dict)
    kind_count: dict[str, int] = field(default_factory=dict)
    gpu: str = ""
    """The rank's GPU by name ('' on CPU)."""


# --------------------------------------------------------------------------------------------------
# Arithmetic


def idle_share(step_s: float, compute_s: float) -> float:
    """Share of the step a rank spent outside compute."""
    if step_s <= 0:
        raise ValueError(f"step time must be positive, got {step_s}")
    return 1.0 - compute_s / step_s


def theory_idle_share(schedule: str, *, pp: int, n_microbatches: int, stages_per_rank: int,
                      chunk_s: dict[str, float] | None = None) -> float | None:
    """The schedule's idle share of a step by its published formula (module docstring); None for DualPipeV
    without the chunk times (``chunk_s``: mean seconds of 'forward', 'backward_input', 'backward_weight')."""
    p, m = pp, n_microbatches
    if schedule == "1F1B":
        return (p - 1) / (m + p - 1)
    if schedule == "Interleaved1F1B":
        return (p - 1) / (stages_per_rank * m + p - 1)
    if schedule == "ZBVZeroBubble":
        return 0.0
    if schedule == "DualPipeV":
        if chunk_s is None:
            return None
        f, w = chunk_s["forward"], chunk_s["backward_weight"]
        full_backward = chunk_s["backward_input"] + w
        bubble = max(0.0, (p - 1) * ((f + full_backward) + full_backward - 3 * w))
        compute = m * stages_per_rank * (f + full_backward)
        return bubble / (bubble + compute)
    raise ValueError(f"unknown schedule {schedule!r}; one of {', '.join(SCHEDULES)}")


def equal_split_points(n_layers: int, n_stages: int) -> list[str]:
    """Split points giving every stage the same number of blocks (refuses when they do not divide)."""
    if n_layers % n_stages != 0:
        raise ValueError(f"{n_layers} blocks do not split into {n_stages} equal stages: use --n-layers a multiple "
                         f"of {n_stages}")
    per = n_layers // n_stages
    return [f"layers.{i * per}" for i in range(1, n_stages)]


def chunk_means(results: list[RankResult]) -> dict[str, float]:
    """Mean seconds of one chunk of each kind over the ranks (kinds that ran)."""
    totals: dict[str, float] = defaultdict(float)
    counts: dict[str, int] = defaultdict(int)
    for r in results:
        for kind, seconds in r.kind_s.items():
            totals[kind] += seconds
            counts[kind] += r.kind_count[kind]
    return {kind: totals[kind] / counts[kind] for kind in totals if counts[kind]}


# --------------------------------------------------------------------------------------------------
# One rank


class ComputeClock:
    """Time spent inside a runner's stage computations and its loss function. On a CPU: wall and thread CPU
    time around each call. On CUDA: GPU time between events recorded on the compute stream around each call,
    read by ``settle`` once the step is done; this neither blocks the CPU (a device-wide synchronize would
    also wait for pending sends, which wait for the neighbour) nor counts a wait for a receive, which the
    schedule queues on the stream before the call."""

    def __init__(self, runner: PipelineRunner, *, cuda: bool = False) -> None:
        self.cuda = cuda
        self.reset()
        for stage in runner.stages:
            self._wrap(stage, "forward_one_chunk", lambda kwargs: "forward")
            self._wrap(stage, "backward_one_chunk",
                       lambda kwargs: "backward" if kwargs.get("full_backward", True) else "backward_input")
            self._wrap(stage, "backward_weight_one_chunk", lambda kwargs: "backward_weight")
        self._wrap(runner, "loss_fn", lambda kwargs: "loss")

    def reset(self) -> None:
        self.kind_s: dict[str, float] = defaultdict(float)
        self.kind_count: dict[str, int] = defaultdict(int)
        self.cpu_s = 0.0
        self._events: list[tuple[str, torch.cuda.Event, torch.cuda.Event]] = []

    def settle(self) -> None:
        """Add the GPU times of the step's calls (CUDA; call after synchronizing the device)."""
        for kind, start, end in self._events:
            self.kind_s[kind] += start.elapsed_time(end) / 1000
        self._events = []

    @property
    def compute_s(self) -> float:
        return sum(self.kind_s.values())

    def _wrap(self, owner: Any, name: str, kind_of: Callable[[dict[str, Any]], str]) -> None:
        original = getattr(owner, name)

        def timed(*args: Any, **kwargs: Any) -> Any:
            kind = kind_of(kwargs)
            self.kind_count[kind] += 1
            if self.cuda:
                start_event, end_event = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start_event.record()
                try:
                    return original(*args, **kwargs)
                finally:
                    end_event.record()
                    self._events.append((kind, start_event, end_event))
            start, cpu_start = time.perf_counter(), time.thread_time()
            try:
                return original(*args, **kwargs)
            finally:
                self.kind_s[kind] += time.perf_counter() - start
                self.cpu_s += time.thread_time() - cpu_start

        setattr(owner, name, timed)


def layout_for(schedule: str, pp: int, settings: Settings) -> PipelineLayout:
    facts = SCHEDULES[schedule]
    n_stages = pp * facts.default_stages_per_rank
    layout = resolve_pipeline(pp=pp, schedule=schedule, stages_per_rank=0, microbatch_size=settings.microbatch_size,
                              split_points=equal_split_points(settings.n_layers, n_stages), layers_per_stage=0,
                              n_layers=settings.n_layers, local_batch_size=settings.n_microbatches * settings.microbatch_size)
    assert layout is not None  # pp > 1
    return layout


def measure_schedule(rank: int, pp: int, schedule: str, settings: Settings) -> RankResult:
    """This rank's step and compute times for one schedule (every rank of the group calls it together)."""
    spec = get_model_spec(settings.model)
    args = dataclasses.replace(spec.flavors[settings.flavor], n_layers=settings.n_layers,
                               vocab_size=settings.vocab_size)
    layout = layout_for(schedule, pp, settings)
    stage_ids = layout.stage_ids(rank)
    device = torch.device(settings.device, rank) if settings.device == "cuda" else torch.device("cpu")
    torch.manual_seed(0)
    with torch.device("meta"):
        model = spec.model_cls(args)
    modules = build_stage_modules(model, spec.parallel_plan, layout, stage_ids)
    for module in modules:
        module.to_empty(device=device)
        with torch.no_grad():
            module.init_weights()
        module.train()
    world = dist.group.WORLD
    assert world is not None  # the process group is initialised by the rank's entry
    runner = PipelineRunner(layout, modules, stage_ids, group=world, device=device,
                            loss_fn=cross_entropy_sum)
    clock = ComputeClock(runner, cuda=device.type == "cuda")
    barrier = (lambda: dist.barrier(device_ids=[rank])) if device.type == "cuda" else dist.barrier
    batch = settings.n_microbatches * settings.microbatch_size
    tokens = torch.randint(0, settings.vocab_size, (batch, settings.seq_len + 1), generator=torch.Generator().manual_seed(1))
    inputs, labels = tokens[:, :-1].to(device), tokens[:, 1:].to(device)
    global_tokens = torch.tensor(float(labels.numel()), device=device)
    step_s = compute_s = cpu_s = 0.0
    kind_s: dict[str, float] = defaultdict(float)
    kind_count: dict[str, int] = defaultdict(int)
    for step in range(settings.warmup + settings.steps):
        for module in modules:
            module.zero_grad(set_to_none=True)
        clock.reset()
        barrier()
        start = time.perf_counter()
        runner.step(inputs, labels, global_tokens=global_tokens)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            clock.settle()
        barrier()  # the step ends when the last rank is done: a rank that finished early idles until then
        elapsed = time.perf_counter() - start
        if step >= settings.warmup:
            step_s, compute_s, cpu_s = step_s + elapsed, compute_s + clock.compute_s, cpu_s + clock.cpu_s
            for kind in clock.kind_s:
                kind_s[kind] += clock.kind_s[kind]
                kind_count[kind] += clock.kind_count[kind]
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else ""
    return RankResult(pp, schedule, rank, stage_ids, step_s, compute_s, cpu_s, dict(kind_s), dict(kind_count), gpu)


def _rank_entry(rank: int, pp: int, port: int, schedules: list[str], settings: Settings,
                queue: multiprocessing.Queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(pp),
                      OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    try:
        if settings.device == "cuda":
            torch.cuda.set_device(rank)
        dist.init_process_group("nccl" if settings.device == "cuda" else "gloo", rank=rank, world_size=pp)
        for schedule in schedules:
            queue.put((rank, True, measure_schedule(rank, pp, schedule, settings)))
    except BaseException:  # noqa: BLE001 - reported to the parent with the traceback
        queue.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_pipeline(pp: int, schedules: list[str], settings: Settings, *, timeout_s: float = 1800) -> list[RankResult]:
    """Every rank's result for every schedule, on ``pp`` forked processes."""
    # CPU ranks are forked: they inherit the parent's imports of torch and the models. CUDA ranks are spawned,
    # since a CUDA runtime the imports may have started does not survive a fork.
    ctx = multiprocessing.get_context("spawn") if settings.device == "cuda" else multiprocessing.get_context("fork")
    queue = ctx.Queue()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [ctx.Process(target=_rank_entry, args=(rank, pp, port, schedules, settings, queue), daemon=True)
             for rank in range(pp)]
    for p in procs:
        p.start()
    results: list[RankResult] = []
    try:
        deadline = time.monotonic() + timeout_s
        while len(results) < pp * len(schedules):
            try:
                rank, ok, payload = queue.get(timeout=min(5.0, max(0.1, deadline - time.monotonic())))
            except Exception:  # queue.Empty
                if time.monotonic() > deadline or any(p.exitcode not in (None, 0) for p in procs):
                    raise RuntimeError(f"pp={pp}: {len(results)} of {pp * len(schedules)} results before the ranks "
                                       f"stopped (exit codes {[p.exitcode for p in procs]})") from None
                continue
            if not ok:
                raise RuntimeError(f"pp={pp} rank {rank} failed:\n{payload}")
            results.append(payload)
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
                p.join()
    return sorted(results, key=lambda r: (schedules.index(r.schedule), r.rank))


# --------------------------------------------------------------------------------------------------
# Report


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
