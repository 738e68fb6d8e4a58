"""The memory of one pipeline rank: the parameters, gradients and optimizer states of its stages, the
activations of the micro-batches it holds at once (replayed from torch's schedule, distributed/pipeline/
in_flight.py), FSDP's gathered weights and accumulated unsharded gradients, the receive buffers, with the peak
over the moments of memory/pipeline_timeline.py."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from torchtitan_lite.distributed.pipeline.in_flight import max_in_flight, peak_held_bytes
from torchtitan_lite.distributed.pipeline.layout import StageLayout
from torchtitan_lite.memory.activations import (
    ActivationSetup,
    block_backward_working_bytes,
    block_plan,
    block_saved_bytes,
    head_saved_bytes,
    loss_transient_bytes,
)
from torchtitan_lite.memory.estimate_table import gathered_text, mib, optimizer_text, sharding_text
from torchtitan_lite.memory.layout import MASTER_WEIGHT_BYTES, ModelLayout
from torchtitan_lite.memory.optimizer_states import state_bytes
from torchtitan_lite.memory.pipeline_timeline import PipelineRankSizes, pipeline_moments
from torchtitan_lite.memory.rank_sizes import (
    autocast_copies,
    float8_cast_bytes,
    gathered_bytes,
    grad_numel,
    moe_terms,
    optimizer_scratch,
    unsharded_grad_bytes,
)
from torchtitan_lite.memory.terms import CUDA_CONTEXT_BYTES, MemoryEstimate, MemoryTerm
from torchtitan_lite.resolved_run import ResolvedRun


@dataclass(frozen=True)
class _RankBytes:
    """What a pipeline rank's terms state beyond its PipelineRankSizes: the bytes before CPU offload moves
    them to the host, the optimizer's scratch with how it is sized, and the float8 casts."""

    params: int
    states: int
    grads: int
    scratch: int
    scratch_how: str
    float8: int
    sizes: PipelineRankSizes


def pipeline_rank_estimate(run: ResolvedRun, full: ModelLayout, s: ActivationSetup, pp_rank: int) -> MemoryEstimate:
    """The memory of pipeline rank ``pp_rank``: ``full`` restricted to its stages' units."""
    pipe = run.pipeline
    assert pipe is not None
    stages = [pipe.stages[i] for i in pipe.stage_ids(pp_rank)]
    layout = _rank_layout(run, full, stages)
    rank = _rank_bytes(run, layout, s, pp_rank)
    moments = pipeline_moments(rank.sizes)
    terms = _rank_terms(run, layout, s, pp_rank, rank)
    dims = layout.dims
    return MemoryEstimate(terms=tuple(terms), moments=tuple(moments),
                          layout=f"{dims.describe()} (world size {run.world_size})", device_type=run.device_type,
                          world_size=run.world_size, model=layout.counts.describe() if layout.counts else "",
                          all_gather=layout.all_gather_text, pp_rank=pp_rank,
                          stages="; ".join(st.describe() for st in stages))


def _rank_layout(run: ResolvedRun, full: ModelLayout, stages: list[StageLayout]) -> ModelLayout:
    """``full`` restricted to the units of ``stages``: their blocks, the embedding on the first stage and the
    final norm + output head on the last."""
    units = run.model_spec.parallel_plan.fsdp_units([b for st in stages for b in st.blocks], tied=full.tied,
                                                    first=any(st.first for st in stages),
                                                    last=any(st.last for st in stages))
    return full.restricted({u.name for u in units}, modules=len(stages))


def _rank_bytes(run: ResolvedRun, layout: ModelLayout, s: ActivationSetup, pp_rank: int) -> _RankBytes:
    """The rank's bytes: its own parameters, states and gradients, and per stage what one micro-batch keeps
    until its backward, weighed by the micro-batches the schedule holds at once."""
    pipe, ac = run.pipeline, run.activation_checkpoint
    assert pipe is not None
    stage_ids = pipe.stage_ids(pp_rank)
    stages = [pipe.stages[i] for i in stage_ids]
    dims, precision, optimizer = layout.dims, run.precision, run.optimizer
    fsdp, low_bit = dims.fsdp_enabled, optimizer.low_bit
    param_bytes = precision.param_bytes
    reduce_bytes = torch.tensor([], dtype=precision.reduce_dtype).element_size()
    unit_names = sorted({p.unit for p in layout.params})

    params = sum(p.local_numel for p in layout.params) * MASTER_WEIGHT_BYTES
    states = sum(state_bytes(p.local_numel, low_bit) for p in layout.params)
    grads = sum(grad_numel(p, fsdp) for p in layout.params) * MASTER_WEIGHT_BYTES
    scratch, scratch_how = optimizer_scratch(run, layout)
    # Per stage: what one micro-batch keeps until its backward (AC counted from the stage's first block), and
    # on the last stage the logits the schedule keeps as the stage output with the loss's saved log-probs.
    plans = {sid: block_plan(s, ac.mode, ac.selective_option, [int(b) for b in pipe.stages[sid].blocks])
             for sid in stage_ids}
    tail = {sid: _held_loss_bytes(s) + head_saved_bytes(s) if pipe.stages[sid].last else _boundary_bytes(s)
            for sid in stage_ids}
    kept = {sid: sum(k for k, _ in plans[sid]) + tail[sid] for sid in stage_ids}
    held = peak_held_bytes(pipe, pp_rank, kept, {sid: _awaiting_weight_bytes(s, pipe.stages[sid]) for sid in stage_ids})
    unsharded = {u: unsharded_grad_bytes(layout, u, s, fsdp, param_bytes) for u in unit_names}
    float8 = float8_cast_bytes(layout, s)
    block_transient = max(r for sid in stage_ids for _, r in plans[sid]) + block_backward_working_bytes(s) + float8
    # What the loss saved is already held (_held_loss_bytes): the log-probs, or a compiled loss's logits.
    saved_by_loss = s.tokens * s.vocab * (s.compute_bytes if s.compiled_loss else 4)
    loss = loss_transient_bytes(s) - saved_by_loss if any(st.last for st in stages) else 0
    gathered = sum(gathered_bytes(layout, u, param_bytes) for u in unit_names) if fsdp else 0
    if fsdp and run.fsdp_reshard_after_forward != "never":
        # Resharded units are gathered again for every micro-batch: two at once (computing + prefetched).
        gathered = sum(sorted((gathered_bytes(layout, u, param_bytes) for u in unit_names), reverse=True)[:2])
    accumulated = sum(p.global_numel if p.replicated_grad else p.tp_numel for p in layout.params) * reduce_bytes
    recv = sum((0 if st.first else 1) + (0 if st.last else 1) for st in stages) * pipe.n_microbatches * _boundary_bytes(s)
    offload = run.parallelism.fsdp_cpu_offload and fsdp
    sizes = PipelineRankSizes(
        persistent=(0 if offload else params + states) + layout.buffer_bytes,
        autocast_copies=autocast_copies(layout, s), grads=0 if offload else grads,
        fsdp=fsdp, accumulating=run.n_microbatches > 1, gathered=gathered,
        accumulated_grads=accumulated if fsdp else 0,
        reduce_buffer=max((sum(p.tp_numel for p in layout.unit_params(u)) * reduce_bytes for u in unit_names),
                          default=0) if fsdp else 0,
        recv_buffers=recv, held_activations=held, freed_before_blocks=min(tail.values()),
        block_transient=block_transient + max(unsharded.values(), default=0), loss_transient=loss,
        optimizer_scratch=0 if offload else scratch,
    )
    return _RankBytes(params=params, states=states, grads=grads, scratch=scratch, scratch_how=scratch_how,
                      float8=float8, sizes=sizes)


def _rank_terms(run: ResolvedRun, layout: ModelLayout, s: ActivationSetup, pp_rank: int,
                rank: _RankBytes) -> list[MemoryTerm]:
    """The rank's terms, each with how it is sized."""
    pipe, ac, precision = run.pipeline, run.activation_checkpoint, run.precision
    assert pipe is not None
    stage_ids = pipe.stage_ids(pp_rank)
    stages = [pipe.stages[i] for i in stage_ids]
    fsdp, low_bit = layout.dims.fsdp_enabled, run.optimizer.low_bit
    param_bytes = precision.param_bytes
    params, states, grads, scratch, scratch_how, float8, sizes = (
        rank.params, rank.states, rank.grads, rank.scratch, rank.scratch_how, rank.float8, rank.sizes)
    held, loss, recv, gathered = sizes.held_activations, sizes.loss_transient, sizes.recv_buffers, sizes.gathered
    per_stage, most = max_in_flight(pipe, pp_rank)
    offload = run.parallelism.fsdp_cpu_offload and fsdp
    where = " (host: CPU offload)" if offload else ""
    mode = ac.mode if ac.mode != "selective" else f"selective {ac.selective_option}"
    sharding = sharding_text(layout)
    in_flight = ", ".join(f"stage {sid} {per_stage[sid]}" for sid in stage_ids)
    terms = [
        MemoryTerm("parameters", params, f"fp32 master weights of the rank's stages, {sharding}{where}"),
        MemoryTerm("optimizer states", states, optimizer_text(low_bit) + where),
        MemoryTerm("buffers", layout.buffer_bytes, f"fp32 rotary table, one per stage module ({len(stages)})"),
        MemoryTerm("gradients", grads, f"fp32, {sharding}{where}"),
        MemoryTerm("accumulated unsharded grads", sizes.accumulated_grads,
                   f"FSDP gradients summed over the {pipe.n_microbatches} micro-batches in "
                   f"{str(precision.reduce_dtype).removeprefix('torch.')}, reduce-scattered after the last"
                   if fsdp else "no FSDP: .grad accumulates in place"),
        MemoryTerm("optimizer step scratch", scratch, scratch_how),
        MemoryTerm("activations in flight", held,
                   f"AC {mode}: at most {most} micro-batches held at once ({in_flight}), {s.tokens} tokens each, "
                   f"{param_bytes}-byte compute; the last stage's logits and loss log-probs included"),
        MemoryTerm("block backward transient", sizes.block_transient,
                   "one block's recomputation + activation gradients + fresh unsharded gradients"),
        MemoryTerm("loss backward transient", loss, "fp32 gradients in and out of log-softmax of one micro-batch"
                   if loss else "no last stage on this rank"),
        MemoryTerm("pipeline receive buffers", recv,
                   f"{pipe.n_microbatches} micro-batches x (input activations unless first + output gradient "
                   f"unless last) per stage, {mib(_boundary_bytes(s))} each"),
        *moe_terms(layout, s, low_bit),
        MemoryTerm("FSDP gathered params", gathered, gathered_text(run, fsdp, layout)),
        MemoryTerm("autocast weight copies", sizes.autocast_copies,
                   f"{param_bytes}-byte copy of each non-float8 Linear weight" if s.autocast else "no autocast"),
        MemoryTerm("float8 casts", float8, "float8 operands of the largest converted Linear, in the transient"
                   if float8 else "no float8 Linears"),
    ]
    if run.device_type == "cuda":
        terms.append(MemoryTerm("CUDA context", CUDA_CONTEXT_BYTES, "outside the caching allocator (constant)"))
    return terms


def _awaiting_weight_bytes(s: ActivationSetup, stage: StageLayout) -> int:
    """What a micro-batch holds on ``stage`` between its I and W passes (ZBVZeroBubble, DualPipeV):
    ``stage_backward_input`` (torch/distributed/pipelining/_backward.py) keeps the autograd graph
    (retain_graph=True), so every block's full saved set stays, the recomputed one under AC included, plus the
    gradients at the nodes where the weight paths branch off: here one per Linear output (q, k, v, wo, w1,
    w3, w2 of a dense block; an approximation for MoE blocks). The first norm of each block saves the block
    input itself. Measured on the CPU (tests/distributed/test_pipeline_memory_measured.py) this is within 3%
    without activation checkpointing; with it the rank's peak comes out 13-25% higher than estimated here
    (what the checkpoint's recomputation keeps between the two passes is not modelled)."""
    linear_outputs = s.tokens * ((s.hq + 2 * s.hkv) * s.head_dim + 2 * s.ffn + 2 * s.dim) * s.compute_bytes
    blocks = sum(sum(block_saved_bytes(s, int(b)).values()) + linear_outputs for b in stage.blocks)
    return blocks + (_held_loss_bytes(s) + head_saved_bytes(s) if stage.last else _boundary_bytes(s))


def _boundary_bytes(s: ActivationSetup) -> int:
    """One micro-batch of the residual stream between stages (sequence-sharded under SP): what a stage sends,
    receives, and keeps as its output until the backward."""
    return s.tokens // s.sp * s.dim * s.residual_bytes


def _held_loss_bytes(s: ActivationSetup) -> int:
    """What the last stage keeps per in-flight micro-batch beyond the head: the schedule computes the loss in
    the forward action and keeps the output (the logits) and the loss graph (float32 log-probs; a compiled loss
    keeps nothing more) until that micro-batch's backward."""
    return s.tokens * s.vocab * s.compute_bytes + (0 if s.compiled_loss else 4 * s.tokens * s.vocab)
