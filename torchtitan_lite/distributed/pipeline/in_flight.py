"""Micro-batches whose activations a pipeline rank holds at once, read off torch's own schedule.

Each looped torch.distributed.pipelining schedule computes, for every pipeline rank, the ordered list of
actions that rank runs (``_calculate_single_rank_operations``, executed as listed by
``_PipelineScheduleRuntime``): a forward (F), a full backward (B), or the zero-bubble split into
backward-for-inputs (I) and backward-for-weights (W), each of one micro-batch on one stage.
``rank_actions`` asks the schedule class for that list (it reads nothing but the pipeline's sizes, so no stage
or process group is needed). Schedule1F1B runs its own loop instead (``Schedule1F1B._step_microbatches``:
min(m, p - r) warm-up forwards, then backward before forward), which ``rank_actions`` writes out the same
way; its ``_get_pipeline_order``, a picture of the schedule, puts the steady state's forward first and would
count one micro-batch too many. ``held_counts`` replays the actions: a micro-batch's activations on a stage
are held from its F until its B, or until its W (the I pass keeps the autograd graph alive for the W pass:
``stage_backward_input`` retains it, and the estimate weighs that state on its own), and the counts are taken
after every action, in the order the rank runs them.

What the replay gives (p ranks, m micro-batches, v stages per rank; checked in
tests/unit/test_pipeline_memory.py):

- 1F1B (m >= p): rank r (stage r) holds p - r micro-batches at most, the last rank 1;
- Interleaved1F1B: rank r holds min(v m, (v - 1) p + 2 (p - 1 - r) + 1) over its v stages (Megatron's
  warm-up count), 8 + 14 + 1 = 23 on rank 0 of p 8, v 2, m >= 8;
- ZBVZeroBubble (m >= 2p): every rank 2p over its two stages (rank r: up to 2p - r on stage r, r + 1 on
  stage 2p - 1 - r);
- DualPipeV (m >= 2p): every rank 2p + 1 (one more than ZBV: the overlapped forward runs before the
  backward it is paired with).

The memory estimate weighs each held micro-batch by its stage's activations and takes the largest sum over
the replay (``peak_held_bytes``), so a rank whose stages differ in size is sized at the moment it really
peaks; tests/distributed/test_pipeline_memory_measured.py holds the result against the CPU profiler on two
gloo ranks.
"""
from __future__ import annotations

from collections.abc import Iterator
from types import SimpleNamespace

from torch.distributed.pipelining import schedules

from torchtitan_lite.distributed.pipeline.layout import PipelineLayout

Action = tuple[str, int, int]
"""(kind: 'F' | 'B' | 'I' | 'W', stage, micro-batch)."""


def rank_actions(layout: PipelineLayout, pp_rank: int) -> list[Action]:
    """The compute actions rank ``pp_rank`` runs in one step, in order, as torch's schedule lists them."""
    pp, m, n_stages = layout.pp, layout.n_microbatches, layout.n_stages
    rounds = max(1, m // pp)
    # The attributes the schedules' planning methods read (set by their constructors from the stages).
    sizes = SimpleNamespace(_n_microbatches=m, _num_stages=n_stages, num_stages=n_stages, pp_group_size=pp,
                            n_local_stages=layout.stages_per_rank, number_of_rounds=rounds,
                            microbatches_per_round=m // rounds, rank=pp_rank)
    if not layout.facts.looped:
        return _one_f_one_b(pp_rank, pp=pp, m=m)
    order = getattr(schedules, layout.facts.torch_class)._calculate_single_rank_operations(sizes, pp_rank)
    actions: list[Action] = []
    for action in order:
        if action is None:
            continue
        for a in action.sub_actions or (action,):
            kind = a.computation_type.value
            if kind in ("F", "B", "I", "W"):
                actions.append((kind, a.stage_index, a.microbatch_index))
    return actions


def _one_f_one_b(rank: int, *, pp: int, m: int) -> list[Action]:
    """Schedule1F1B._step_microbatches on stage ``rank``: warm-up forwards, then 1B1F, then the last backwards."""
    warmup = min(m, pp - rank)
    actions: list[Action] = [("F", rank, i) for i in range(warmup)]
    for i in range(m):
        actions.append(("B", rank, i))
        if warmup + i < m:
            actions.append(("F", rank, warmup + i))
    return actions


def held_counts(layout: PipelineLayout, pp_rank: int) -> Iterator[dict[int, tuple[int, int]]]:
    """After each of the rank's actions, per stage: (micro-batches forwarded and not yet backpropagated,
    micro-batches past their I pass waiting for their W pass)."""
    forwarded: set[tuple[int, int]] = set()
    awaiting: set[tuple[int, int]] = set()
    stages = layout.stage_ids(pp_rank)
    for kind, stage, microbatch in rank_actions(layout, pp_rank):
        if kind == "F":
            forwarded.add((stage, microbatch))
        elif kind == "I":
            forwarded.discard((stage, microbatch))
            awaiting.add((stage, microbatch))
        else:  # B, W
            forwarded.discard((stage, microbatch))
            awaiting.discard((stage, microbatch))
        yield {s: (sum(1 for h, _ in forwarded if h == s), sum(1 for h, _ in awaiting if h == s)) for s in stages}


def max_in_flight(layout: PipelineLayout, pp_rank: int) -> tuple[dict[int, int], int]:
    """(most micro-batches each stage of the rank holds at once, most the rank holds over all its stages),
    counting a micro-batch from its F to its B or W."""
    per_stage = dict.fromkeys(layout.stage_ids(pp_rank), 0)
    total = 0
    for counts in held_counts(layout, pp_rank):
        for stage, (f, i) in counts.items():
            per_stage[stage] = max(per_stage[stage], f + i)
        total = max(total, sum(f + i for f, i in counts.values()))
    return per_stage, total


def peak_held_bytes(layout: PipelineLayout, pp_rank: int, stage_bytes: dict[int, int],
                    awaiting_weight_bytes: dict[int, int] | None = None) -> int:
    """The most activation bytes the rank holds at once: each forwarded micro-batch weighs its stage's
    ``stage_bytes``, each one between its I and W pass ``awaiting_weight_bytes`` (default: the same)."""
    after_input = awaiting_weight_bytes or stage_bytes
    return max((sum(f * stage_bytes[s] + i * after_input[s] for s, (f, i) in counts.items())
                for counts in held_counts(layout, pp_rank)), default=0)
