"""Which blocks each pipeline stage holds and which stages each rank runs, decided once from the config.

``resolve_pipeline`` is arithmetic on the config and the model's block count, so every refusal (a schedule
and a stage count that do not go together, micro-batches the schedule cannot order, a split point that names
no block) happens at resolve time, before a process group exists. The trainer, ``--estimate-memory`` and
``--dry-run`` all read the resulting ``PipelineLayout``.

The automatic split counts the embedding and the output head as one block each: the first stage holds the
embedding and one block fewer than an even share, the last the final norm and output head and one block
fewer. Blocks left over after an even division go to the stages in the middle first (the second stage on).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

EMBEDDING_WEIGHT = 1
"""Blocks' worth of work the automatic split charges for the embedding (the first stage)."""
HEAD_WEIGHT = 1
"""Blocks' worth the automatic split charges for the final norm and output head (the last stage): at 405B the
head (vocab x dim = 2.1e9 parameters, a 128k-wide GEMM) is about two thirds of a block's 3.2e9."""


@dataclass(frozen=True)
class ScheduleFacts:
    """What the layout needs to know of one torch.distributed.pipelining schedule."""

    torch_class: str
    """Class name in torch.distributed.pipelining."""
    looped: bool
    """Several stages per rank (PipelineScheduleMulti)."""
    style: Literal["loop", "v"]
    """Stage placement: 'loop' puts stage s on rank s % pp; 'v' puts stages r and 2 pp - 1 - r on rank r."""
    default_stages_per_rank: int
    fixed_stages_per_rank: bool
    """The schedule accepts only its default number of stages per rank."""
    split_backward: bool = False
    """Runs a micro-batch's backward in two passes (input gradients, later weight gradients), each of which
    recomputes an activation-checkpointed block."""


SCHEDULES: dict[str, ScheduleFacts] = {
    "1F1B": ScheduleFacts("Schedule1F1B", looped=False, style="loop", default_stages_per_rank=1,
                          fixed_stages_per_rank=True),
    "Interleaved1F1B": ScheduleFacts("ScheduleInterleaved1F1B", looped=True, style="loop", default_stages_per_rank=2,
                                     fixed_stages_per_rank=False),
    "ZBVZeroBubble": ScheduleFacts("ScheduleZBVZeroBubble", looped=True, style="v", default_stages_per_rank=2,
                                   fixed_stages_per_rank=True, split_backward=True),
    "DualPipeV": ScheduleFacts("ScheduleDualPipeV", looped=True, style="v", default_stages_per_rank=2,
                               fixed_stages_per_rank=True, split_backward=True),
}


@dataclass(frozen=True)
class StageLayout:
    index: int
    blocks: tuple[str, ...]
    """Keys of the blocks this stage holds (in model.<blocks>), in order."""
    first: bool
    """Holds the embedding (reads token ids)."""
    last: bool
    """Holds the final norm and the output head (computes the loss)."""

    def describe(self) -> str:
        parts = (["embedding"] if self.first else []) + [_block_range(self.blocks)] + (["head"] if self.last else [])
        return f"stage {self.index}: " + " + ".join(parts)


@dataclass(frozen=True)
class PipelineLayout:
    pp: int
    schedule: str
    stages_per_rank: int
    n_microbatches: int
    """Pipeline micro-batches per local batch (training.local_batch_size / pipeline_microbatch_size)."""
    microbatch_size: int
    stages: tuple[StageLayout, ...]

    @property
    def facts(self) -> ScheduleFacts:
        return SCHEDULES[self.schedule]

    @property
    def n_stages(self) -> int:
        return len(self.stages)

    def stage_ids(self, pp_rank: int) -> tuple[int, ...]:
        """The stages rank ``pp_rank`` of the pipeline runs, in the order the schedule expects."""
        if self.facts.style == "v":
            return (pp_rank, 2 * self.pp - 1 - pp_rank)
        return tuple(pp_rank + k * self.pp for k in range(self.stages_per_rank))

    def rank_of_stage(self, stage: int) -> int:
        return next(r for r in range(self.pp) if stage in self.stage_ids(r))

    def describe(self) -> str:
        return (f"PP {self.pp} ({self.schedule}, {self.n_stages} stages, {self.stages_per_rank} per rank, "
                f"{self.n_microbatches} micro-batches of {self.microbatch_size})")

    def summary(self) -> str:
        """``describe`` and the blocks of each stage, for --check-config."""
        blocks = ", ".join(str(len(stage.blocks)) for stage in self.stages)
        return f"{self.describe()}; blocks per stage {blocks} (the first adds the embedding, the last the head)"


PP1_DEFAULTS = {"schedule": "1F1B", "stages_per_rank": 0, "microbatch_size": 1}
"""The pipeline options' defaults (ParallelismConfig): the only values a run without a pipeline accepts."""


def resolve_pipeline(*, pp: int, schedule: str, stages_per_rank: int, microbatch_size: int,
                     split_points: list[str] | tuple[str, ...], layers_per_stage: int, n_layers: int,
                     local_batch_size: int, blocks: str, tied_embeddings: bool = False,
                     compiled_blocks: bool = False) -> PipelineLayout | None:
    """The pipeline layout of a run, or None without pipeline parallelism (pp 1). Refuses with the fix."""
    if pp == 1:
        if split_points or layers_per_stage:
            raise ValueError(
                "parallelism.pipeline_split_points / pipeline_layers_per_stage split the model into pipeline "
                "stages, but parallelism.pp=1: set --parallelism.pp to the number of pipeline ranks, or drop them")
        # Without a pipeline these options would be accepted and do nothing: refused, like the split above.
        unused = [f"{name}={value}" for name, value, default in (
            ("pipeline_schedule", schedule, PP1_DEFAULTS["schedule"]),
            ("pipeline_stages_per_rank", stages_per_rank, PP1_DEFAULTS["stages_per_rank"]),
            ("pipeline_microbatch_size", microbatch_size, PP1_DEFAULTS["microbatch_size"])) if value != default]
        if unused:
            raise ValueError(
                f"parallelism.{', parallelism.'.join(unused)} configure(s) a pipeline, but parallelism.pp=1 runs "
                f"none, so it would be ignored: set --parallelism.pp to the number of pipeline ranks, or drop it")
        return None
    if schedule not in SCHEDULES:
        raise ValueError(f"parallelism.pipeline_schedule={schedule!r} is not one of {', '.join(SCHEDULES)}")
    facts = SCHEDULES[schedule]
    if tied_embeddings:
        raise ValueError(
            f"parallelism.pp={pp} cannot split a model whose embedding and output head share one matrix "
            "(tie_word_embeddings): they live on the first and the last stage. Use a flavor with untied embeddings "
            "or parallelism.pp=1")
    if compiled_blocks and facts.split_backward:
        raise ValueError(
            f"parallelism.pipeline_schedule={schedule} splits each backward into an input-gradient and a "
            "weight-gradient pass over one retained graph, which compiled blocks do not allow (their backward "
            "donates its buffers and runs once): use the 1F1B or Interleaved1F1B schedule, or compile only the "
            "loss (--compile.components loss)")
    n_stages = _n_stages(pp, facts, stages_per_rank, layers_per_stage, n_layers, schedule)
    if n_stages > n_layers:
        raise ValueError(
            f"{n_stages} pipeline stages (pp={pp} x {n_stages // pp} per rank) need at least one block each, but "
            f"the model has {n_layers}; lower parallelism.pp or the stages per rank")
    if local_batch_size % microbatch_size != 0:
        raise ValueError(
            f"training.local_batch_size={local_batch_size} must be a multiple of "
            f"parallelism.pipeline_microbatch_size={microbatch_size}: the pipeline cuts each local batch into "
            f"micro-batches of that size")
    n_microbatches = local_batch_size // microbatch_size
    _check_microbatches(schedule, n_microbatches, pp=pp, n_stages=n_stages, microbatch_size=microbatch_size)
    if split_points:
        groups = _explicit_split(list(split_points), n_layers, n_stages, blocks)
    else:
        groups = _even_split(n_layers, n_stages)
    stages = tuple(StageLayout(index=i, blocks=tuple(str(b) for b in group), first=i == 0, last=i == n_stages - 1)
                   for i, group in enumerate(groups))
    return PipelineLayout(pp=pp, schedule=schedule, stages_per_rank=n_stages // pp, n_microbatches=n_microbatches,
                          microbatch_size=microbatch_size, stages=stages)


def check_pipeline_expert_parallel(layout: PipelineLayout | None, *, ep: int, ac_mode: str) -> None:
    """Expert parallelism with activation checkpointing replays each checkpointed block's exchanges in its
    recomputation, taking them in the order of the forwards (models/common/moe/all_to_all_dispatch.py): 1F1B and
    Interleaved1F1B backpropagate each stage's micro-batches in their forward order and recompute each once.
    The schedules that split the backward recompute a block twice per micro-batch, which no queue of
    exchanges can serve. Refused here, before any work."""
    if layout is None or ep == 1 or ac_mode == "none" or not layout.facts.split_backward:
        return
    raise ValueError(
        f"parallelism.pipeline_schedule={layout.schedule} with parallelism.ep={ep} and activation_checkpoint.mode="
        f"{ac_mode} is not supported: this schedule computes each micro-batch's input and weight gradients in two "
        f"passes, each recomputing a checkpointed block, and the second cannot replay the block's expert-parallel "
        f"exchanges. Use --parallelism.pipeline_schedule 1F1B or Interleaved1F1B, or --activation_checkpoint.mode none")


def _n_stages(pp: int, facts: ScheduleFacts, stages_per_rank: int, layers_per_stage: int, n_layers: int,
              schedule: str) -> int:
    if layers_per_stage:
        n_stages = math.ceil((n_layers + EMBEDDING_WEIGHT + HEAD_WEIGHT) / layers_per_stage)
        if n_stages % pp != 0:
            raise ValueError(
                f"parallelism.pipeline_layers_per_stage={layers_per_stage} makes {n_stages} stages "
                f"(({n_layers} blocks + embedding + head) / {layers_per_stage}, rounded up), not a multiple of "
                f"parallelism.pp={pp}; choose a value that gives a multiple of {pp} stages")
        if stages_per_rank and stages_per_rank != n_stages // pp:
            raise ValueError(
                f"parallelism.pipeline_layers_per_stage={layers_per_stage} makes {n_stages // pp} stages per rank "
                f"but parallelism.pipeline_stages_per_rank={stages_per_rank}; set one of them")
        stages_per_rank = n_stages // pp
    stages_per_rank = stages_per_rank or facts.default_stages_per_rank
    if facts.fixed_stages_per_rank and stages_per_rank != facts.default_stages_per_rank:
        raise ValueError(
            f"parallelism.pipeline_schedule={schedule} runs exactly {facts.default_stages_per_rank} stage(s) per rank, "
            f"got {stages_per_rank}; "
            + ("use Interleaved1F1B for several stages per rank" if not facts.looped else
               "set parallelism.pipeline_stages_per_rank=2 (or 0)"))
    if schedule == "Interleaved1F1B" and stages_per_rank < 2:
        raise ValueError("parallelism.pipeline_schedule=Interleaved1F1B loops over several stages per rank, got 1; "
                         "use pipeline_stages_per_rank >= 2, or the 1F1B schedule for one stage per rank")
    return pp * stages_per_rank


def _check_microbatches(schedule: str, n: int, *, pp: int, n_stages: int, microbatch_size: int) -> None:
    """The micro-batch counts each torch schedule accepts (the rules its constructor enforces)."""
    fix = (f"change training.local_batch_size or parallelism.pipeline_microbatch_size={microbatch_size} "
           f"({n} micro-batches now)")
    if schedule == "1F1B" and n < pp:
        raise ValueError(f"the 1F1B schedule needs at least as many micro-batches as stages ({pp}): {fix}")
    if schedule == "DualPipeV" and n < n_stages:
        raise ValueError(f"the DualPipeV schedule needs at least as many micro-batches as stages ({n_stages}): {fix}")
    # ZBVZeroBubble takes any count: its order is built for max(2 pp - 1, n) micro-batches and cut to n.
    if schedule == "Interleaved1F1B" and not interleaved_microbatches_fit(n, pp=pp):
        below = max(m for m in range(1, n) if interleaved_microbatches_fit(m, pp=pp))
        above = next(m for m in range(n + 1, 2 * n + 1) if interleaved_microbatches_fit(m, pp=pp))
        raise ValueError(f"the {schedule} schedule cuts its micro-batches into n // pp = {n} // {pp} = {n // pp} rounds "
                         f"of equal size, and {n} is not a multiple of {n // pp}: it takes any count below {2 * pp} "
                         f"(2 pp) and, from {2 * pp} on, a multiple of n // pp, such as {below} or {above}: {fix}")


def interleaved_microbatches_fit(n: int, *, pp: int) -> bool:
    """Whether torch's Interleaved1F1B takes ``n`` micro-batches on ``pp`` ranks: it runs them in max(1, n // pp)
    rounds of equal size, so any n below 2 pp (one round), else a multiple of n // pp."""
    return n % max(1, n // pp) == 0


def _even_split(n_layers: int, n_stages: int) -> list[list[int]]:
    """Blocks per stage with the embedding and the head charged to the first and last stage (module docstring)."""
    units = n_layers + EMBEDDING_WEIGHT + HEAD_WEIGHT
    base, extra = divmod(units, n_stages)
    # The remainder goes to the middle stages first, then to the last and the first.
    order = list(range(1, n_stages - 1)) + [n_stages - 1, 0]
    sizes = [base] * n_stages
    for stage in order[:extra]:
        sizes[stage] += 1
    sizes[0] -= EMBEDDING_WEIGHT
    sizes[-1] -= HEAD_WEIGHT
    if min(sizes) < 1:
        # Few blocks per stage: the embedding / head charge would leave an end stage empty.
        base, extra = divmod(n_layers, n_stages)
        sizes = [base + (1 if i < extra else 0) for i in range(n_stages)]
    groups, start = [], 0
    for size in sizes:
        groups.append(list(range(start, start + size)))
        start += size
    return groups


def _explicit_split(points: list[str], n_layers: int, n_stages: int, blocks: str) -> list[list[int]]:
    if len(points) != n_stages - 1:
        raise ValueError(
            f"parallelism.pipeline_split_points names {len(points)} boundaries, but {n_stages} stages need "
            f"{n_stages - 1} (the first block of every stage but the first, e.g. '{blocks}.4')")
    starts = []
    for point in points:
        prefix, _, index = point.rpartition(".")
        if prefix != blocks or not index.isdigit() or not 0 < int(index) < n_layers:
            raise ValueError(
                f"parallelism.pipeline_split_points entry {point!r} is not a block boundary: use '{blocks}.<i>' "
                f"with 0 < i < {n_layers} (the first block of a stage)")
        starts.append(int(index))
    if starts != sorted(set(starts)):
        raise ValueError(f"parallelism.pipeline_split_points {points} must name distinct blocks in increasing order")
    bounds = [0, *starts, n_layers]
    return [list(range(a, b)) for a, b in zip(bounds, bounds[1:], strict=False)]


def _block_range(blocks: tuple[str, ...]) -> str:
    if not blocks:
        return "no blocks"
    return f"block {blocks[0]}" if len(blocks) == 1 else f"blocks {blocks[0]}-{blocks[-1]}"
