"""The memory of one pipeline rank: the parameters, gradients and optimizer states of its stages (the rank's
RankSizes, memory/rank_sizes.py), the activations of the micro-batches it holds at once (replayed from torch's
schedule, distributed/pipeline/in_flight.py), FSDP's gathered weights and accumulated unsharded gradients, the
receive buffers, with the peak over the moments of memory/pipeline_timeline.py."""
from __future__ import annotations

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
from torchtitan_lite.memory.context_parallel import (
    context_parallel_setup,
    context_parallel_terms,
    with_context_parallel,
)
from torchtitan_lite.memory.estimate_table import gathered_text, mib, optimizer_text, sharding_text
from torchtitan_lite.memory.pipeline_timeline import PipelineRankSizes, pipeline_moments
from torchtitan_lite.memory.rank_sizes import RankSizes, moe_terms
from torchtitan_lite.memory.terms import MemoryTerm
from torchtitan_lite.memory.timeline import Moment
from torchtitan_lite.resolved_run import ResolvedRun


def pipeline_rank(run: ResolvedRun, s: ActivationSetup, rank: RankSizes,
                  pp_rank: int) -> tuple[list[MemoryTerm], list[Moment]]:
    """The terms and moments of pipeline rank ``pp_rank``, holding ``rank`` (its stages' units)."""
    sizes = _pipeline_sizes(run, s, rank, pp_rank)
    return _rank_terms(run, s, pp_rank, rank, sizes), pipeline_moments(sizes)


def _pipeline_sizes(run: ResolvedRun, s: ActivationSetup, rank: RankSizes, pp_rank: int) -> PipelineRankSizes:
    """Per stage what one micro-batch keeps until its backward, weighed by the micro-batches the schedule holds
    at once, beside the rank's own parameters, states and gradients."""
    pipe, layout = run.pipeline, rank.layout
    assert pipe is not None
    stage_ids = pipe.stage_ids(pp_rank)
    stages = [pipe.stages[i] for i in stage_ids]
    fsdp, offload = rank.fsdp, rank.offload
    # Per stage: what one micro-batch keeps until its backward (AC counted from the stage's first block), and
    # on the last stage the logits the schedule keeps as the stage output with the loss's saved log-probs.
    # Context parallelism's gathered K/V and each stage's attention mask join its blocks' (none at cp 1, causal).
    cp = context_parallel_setup(run)
    plans = {sid: with_context_parallel(block_plan(s, run.ac_mode, run.ac_selective_option,
                                                   [int(b) for b in pipe.stages[sid].blocks]),
                                        cp, run.ac_mode, run.ac_selective_option)
             for sid in stage_ids}
    tail = {sid: _held_loss_bytes(s) + head_saved_bytes(s) if pipe.stages[sid].last else _boundary_bytes(s)
            for sid in stage_ids}
    kept = {sid: sum(k for k, _ in plans[sid]) + tail[sid] for sid in stage_ids}
    held = peak_held_bytes(pipe, pp_rank, kept, {sid: _awaiting_weight_bytes(s, pipe.stages[sid]) for sid in stage_ids})
    block_transient = (max(r for sid in stage_ids for _, r in plans[sid]) + block_backward_working_bytes(s) + rank.float8
                       + (cp.gradient_bytes() if cp is not None else 0))
    # What the loss saved is already held (_held_loss_bytes): the log-probs, or a compiled loss's logits.
    saved_by_loss = s.tokens * s.vocab * (s.compute_bytes if s.compiled_loss else 4)
    loss = loss_transient_bytes(s) - saved_by_loss if any(st.last for st in stages) else 0
    gathered = sum(rank.gathered.values())
    if fsdp and run.fsdp_reshard_after_forward != "never":
        # Resharded units are gathered again for every micro-batch: two at once (computing + prefetched).
        gathered = sum(sorted(rank.gathered.values(), reverse=True)[:2])
    accumulated = sum(p.global_numel if p.replicated_grad else p.tp_numel for p in layout.params) * rank.reduce_bytes
    recv = sum((0 if st.first else 1) + (0 if st.last else 1) for st in stages) * pipe.n_microbatches * _boundary_bytes(s)
    return PipelineRankSizes(
        persistent=rank.persistent, autocast_copies=rank.autocast_copies,
        grads=0 if offload else sum(rank.grads.values()), fsdp=fsdp, accumulating=run.n_microbatches > 1,
        gathered=gathered, accumulated_grads=accumulated if fsdp else 0,
        reduce_buffer=max(rank.reduce_buffers.values(), default=0),
        recv_buffers=recv, held_activations=held, freed_before_blocks=min(tail.values()),
        block_transient=block_transient + max(rank.unsharded.values(), default=0), loss_transient=loss,
        optimizer_scratch=0 if offload else rank.scratch,
    )


def _rank_terms(run: ResolvedRun, s: ActivationSetup, pp_rank: int, rank: RankSizes,
                sizes: PipelineRankSizes) -> list[MemoryTerm]:
    """The rank's terms, each with how it is sized."""
    pipe, precision, layout = run.pipeline, run.precision, rank.layout
    assert pipe is not None
    stages = [pipe.stages[i] for i in pipe.stage_ids(pp_rank)]
    stage_ids = pipe.stage_ids(pp_rank)
    fsdp, low_bit = rank.fsdp, run.optimizer_low_bit
    param_bytes = precision.param_bytes
    held, loss, recv, gathered = sizes.held_activations, sizes.loss_transient, sizes.recv_buffers, sizes.gathered
    per_stage, most = max_in_flight(pipe, pp_rank)
    where = " (host: CPU offload)" if rank.offload else ""
    mode = run.ac_mode if run.ac_mode != "selective" else f"selective {run.ac_selective_option}"
    sharding = sharding_text(layout)
    in_flight = ", ".join(f"stage {sid} {per_stage[sid]}" for sid in stage_ids)
    terms = [
        MemoryTerm("parameters", rank.params, f"fp32 master weights of the rank's stages, {sharding}{where}"),
        MemoryTerm("optimizer states", rank.states, optimizer_text(low_bit) + where),
        MemoryTerm("buffers", layout.buffer_bytes, f"fp32 rotary table, one per stage module ({len(stages)})"),
        MemoryTerm("gradients", sum(rank.grads.values()), f"fp32, {sharding}{where}"),
        MemoryTerm("accumulated unsharded grads", sizes.accumulated_grads,
                   f"FSDP gradients summed over the {pipe.n_microbatches} micro-batches in "
                   f"{str(precision.reduce_dtype).removeprefix('torch.')}, reduce-scattered after the last"
                   if fsdp else "no FSDP: .grad accumulates in place"),
        MemoryTerm("optimizer step scratch", rank.scratch, rank.scratch_how),
        MemoryTerm("activations in flight", held,
                   f"AC {mode}: at most {most} micro-batches held at once ({in_flight}), {s.tokens} tokens each, "
                   f"{param_bytes}-byte compute; the last stage's logits and loss log-probs included"),
        MemoryTerm("block backward transient", sizes.block_transient,
                   "one block's recomputation + activation gradients + fresh unsharded gradients"),
        *[MemoryTerm(t.name, t.nbytes, f"{t.how} (of activations in flight / block backward transient above, per "
                     "micro-batch)") for t in context_parallel_terms(context_parallel_setup(run), run.ac_mode,
                                                                    run.ac_selective_option,
                                                                    sum(len(st.blocks) for st in stages))],
        MemoryTerm("loss backward transient", loss, "fp32 gradients in and out of log-softmax of one micro-batch"
                   if loss else "no last stage on this rank"),
        MemoryTerm("pipeline receive buffers", recv,
                   f"{pipe.n_microbatches} micro-batches x (input activations unless first + output gradient "
                   f"unless last) per stage, {mib(_boundary_bytes(s))} each"),
        *moe_terms(layout, s, low_bit),
        MemoryTerm("FSDP gathered params", gathered, gathered_text(run, fsdp, layout)),
        MemoryTerm("autocast weight copies", sizes.autocast_copies,
                   f"{param_bytes}-byte copy of each non-float8 Linear weight" if s.autocast else "no autocast"),
        MemoryTerm("float8 casts", rank.float8, "float8 operands of the largest converted Linear, in the transient"
                   if rank.float8 else "no float8 Linears"),
    ]
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
