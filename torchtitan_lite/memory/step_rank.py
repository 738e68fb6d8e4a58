"""The rank of a run without a pipeline, one stage holding the whole model and running it once per
micro-batch: the terms of memory/estimate.py's list, with the peak over the moments of memory/timeline.py."""
from __future__ import annotations

from torchtitan_lite.memory.activations import (
    ActivationSetup,
    block_backward_working_bytes,
    block_plan,
    head_saved_bytes,
    logits_grad_bytes,
    loss_transient_bytes,
)
from torchtitan_lite.memory.context_parallel import (
    context_parallel_setup,
    context_parallel_terms,
    with_context_parallel,
)
from torchtitan_lite.memory.estimate_table import gathered_text, mib, optimizer_text, sharding_text
from torchtitan_lite.memory.rank_sizes import RankSizes, moe_terms
from torchtitan_lite.memory.terms import MemoryTerm
from torchtitan_lite.memory.timeline import Moment, StepSizes, step_moments
from torchtitan_lite.resolved_run import ResolvedRun


def step_rank(run: ResolvedRun, s: ActivationSetup, rank: RankSizes) -> tuple[list[MemoryTerm], list[Moment]]:
    """The terms and moments of the rank holding ``rank`` (the whole model) in a step without a pipeline."""
    param_bytes, layout = run.precision.param_bytes, rank.layout
    offload = rank.offload
    plan = block_plan(s, run.ac_mode, run.ac_selective_option)
    # Context parallelism's gathered K/V and the attention mask join the blocks' activations (none at cp 1, causal).
    cp = context_parallel_setup(run)
    block_working = block_backward_working_bytes(s) + rank.float8
    sizes = StepSizes(
        persistent=rank.persistent, grads={u: 0 if offload else g for u, g in rank.grads.items()},
        unsharded_grads=rank.unsharded, reduce_buffers=rank.reduce_buffers, gathered=rank.gathered,
        block_plan=with_context_parallel(plan, cp, run.ac_mode, run.ac_selective_option),
        head_saved=head_saved_bytes(s), autocast_copies=rank.autocast_copies,
        loss_transient=loss_transient_bytes(s), logits_grad=logits_grad_bytes(s),
        block_working=block_working + (cp.gradient_bytes() if cp is not None else 0),
        optimizer_scratch=0 if offload else rank.scratch,
        accumulating=run.n_microbatches > 1, reshard_after_forward=run.fsdp_reshard_after_forward,
        block_units=rank.units_of("block"), embedding_unit=next(iter(rank.units_of("embedding")), None),
        head_units=tuple(u for u in rank.units_of("head", "root") if u in rank.grads),
    )
    moments = step_moments(sizes)

    sharding = sharding_text(layout)
    where = " (host: CPU offload)" if offload else ""
    mode = run.ac_mode if run.ac_mode != "selective" else f"selective {run.ac_selective_option}"
    kept = [k for k, _ in plan]
    terms = [
        MemoryTerm("parameters", rank.params, f"fp32 master weights, {sharding}{where}"),
        MemoryTerm("optimizer states", rank.states, optimizer_text(run.optimizer_low_bit) + where),
        MemoryTerm("buffers", layout.buffer_bytes, "fp32 rotary table, replicated"),
        MemoryTerm("gradients", sum(rank.grads.values()), f"fp32, {sharding}{where}"),
        MemoryTerm("optimizer step scratch", sizes.optimizer_scratch, rank.scratch_how),
        MemoryTerm("activations", sum(kept),
                   f"AC {mode}: {len(kept)} blocks x {mib(max(kept))} max, {s.tokens} tokens/micro-batch, "
                   f"{param_bytes}-byte compute"),
        MemoryTerm("head activations", sizes.head_saved, "final norm + output projection input"),
        MemoryTerm("loss transient", sizes.loss_transient,
                   "compiled: logits + their gradient" if s.compiled_loss else "fp32 log-probs + 2 fp32 gradients"),
        MemoryTerm("block backward transient", max(r for _, r in plan) + block_working,
                   "recomputed activations (AC) + activation gradients of one block"),
        *context_parallel_terms(cp, run.ac_mode, run.ac_selective_option, len(plan)),
        *moe_terms(layout, s, run.optimizer_low_bit),
        MemoryTerm("FSDP gathered params", max(m.parts.get("FSDP gathered", 0) for m in moments),
                   gathered_text(run, rank.fsdp, layout)),
        MemoryTerm("autocast weight copies", sizes.autocast_copies,
                   f"{param_bytes}-byte copy of each non-float8 Linear weight" if s.autocast else "no autocast"),
        MemoryTerm("float8 casts", rank.float8, "float8 operands of the largest converted Linear" if rank.float8
                   else "no float8 Linears"),
    ]
    return terms, moments
