"""The measured side of the pipeline bubble: ranks that build the stages as the trainer does, time every chunk
they compute inside each step, and report their timings to the parent process."""
from __future__ import annotations

import dataclasses
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from torchtitan_lite.components.loss import cross_entropy_sum
from torchtitan_lite.distributed.pipeline import SCHEDULES, build_stage_modules, resolve_pipeline
from torchtitan_lite.distributed.pipeline.layout import PipelineLayout
from torchtitan_lite.distributed.pipeline.runner import PipelineRunner
from torchtitan_lite.protocols.model_spec import get_model_spec
from torchtitan_lite.tools.pipeline_bubble_theory import equal_split_points
from torchtitan_lite.tools.rank_processes import run_on_ranks

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


def chunk_means(results: list[RankResult]) -> dict[str, float]:
    """Mean seconds of one chunk of each kind over the ranks (kinds that ran)."""
    totals: dict[str, float] = defaultdict(float)
    counts: dict[str, int] = defaultdict(int)
    for r in results:
        for kind, seconds in r.kind_s.items():
            totals[kind] += seconds
            counts[kind] += r.kind_count[kind]
    return {kind: totals[kind] / counts[kind] for kind in totals if counts[kind]}


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
    blocks = get_model_spec(settings.model).parallel_plan.blocks
    layout = resolve_pipeline(pp=pp, schedule=schedule, stages_per_rank=0, microbatch_size=settings.microbatch_size,
                              split_points=equal_split_points(settings.n_layers, n_stages, blocks), layers_per_stage=0,
                              n_layers=settings.n_layers, local_batch_size=settings.n_microbatches * settings.microbatch_size,
                              blocks=blocks)
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


def run_pipeline(pp: int, schedules: list[str], settings: Settings, *, timeout_s: float = 1800) -> list[RankResult]:
    """Every rank's result for every schedule, on ``pp`` processes (forked on CPU, spawned on CUDA)."""
    results = run_on_ranks(pp, measure_schedule, schedules, settings, label=f"pp={pp}", device=settings.device,
                           timeout_s=timeout_s)
    return sorted(results, key=lambda r: (schedules.index(r.schedule), r.rank))
