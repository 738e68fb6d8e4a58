"""The memory of a rank that runs the whole model in one training step (no pipeline): every term of
memory/estimate.py's list, with the peak over the moments of memory/timeline.py."""
from __future__ import annotations

import torch

from torchtitan_lite.memory.activations import (
    block_backward_working_bytes,
    block_plan,
    head_saved_bytes,
    logits_grad_bytes,
    loss_transient_bytes,
)
from torchtitan_lite.memory.estimate_table import gathered_text, mib, optimizer_text, sharding_text
from torchtitan_lite.memory.layout import MASTER_WEIGHT_BYTES, model_layout
from torchtitan_lite.memory.optimizer_states import state_bytes
from torchtitan_lite.memory.rank_sizes import (
    activation_setup,
    autocast_copies,
    float8_cast_bytes,
    gathered_bytes,
    grad_numel,
    moe_terms,
    optimizer_scratch,
    unsharded_grad_bytes,
)
from torchtitan_lite.memory.terms import CUDA_CONTEXT_BYTES, MemoryEstimate, MemoryTerm
from torchtitan_lite.memory.timeline import StepSizes, step_moments
from torchtitan_lite.resolved_run import ResolvedRun


def step_rank_estimate(run: ResolvedRun) -> MemoryEstimate:
    """The per-rank memory of a resolved run without pipeline parallelism."""
    device_type, world_size = run.device_type, run.world_size
    layout = model_layout(run)
    dims, ac = layout.dims, run.activation_checkpoint
    param_bytes = run.precision.param_bytes
    reduce_bytes = torch.tensor([], dtype=run.precision.reduce_dtype).element_size()
    s = activation_setup(run, layout)
    optimizer = run.optimizer
    fsdp = dims.fsdp_enabled
    offload = run.parallelism.fsdp_cpu_offload and fsdp
    units = sorted({p.unit for p in layout.params})
    plan_units = run.model_spec.parallel_plan.fsdp_units(layout.block_keys, first=True, last=True, tied=layout.tied)
    low_bit = optimizer.low_bit

    params = sum(p.local_numel for p in layout.params) * MASTER_WEIGHT_BYTES
    states = sum(state_bytes(p.local_numel, low_bit) for p in layout.params)
    grads = {u: sum(grad_numel(p, fsdp) for p in layout.unit_params(u)) * MASTER_WEIGHT_BYTES for u in units}
    scratch, scratch_how = optimizer_scratch(run, layout)
    plan = block_plan(s, ac.mode, ac.selective_option)
    gathered = {u: gathered_bytes(layout, u, param_bytes) for u in units} if fsdp else {}
    float8 = float8_cast_bytes(layout, s)
    sizes = StepSizes(
        persistent=(0 if offload else params + states) + layout.buffer_bytes,
        grads={u: 0 if offload else g for u, g in grads.items()},
        unsharded_grads={u: unsharded_grad_bytes(layout, u, s, fsdp, param_bytes) for u in units},
        reduce_buffers={u: sum(p.tp_numel for p in layout.unit_params(u)) * reduce_bytes if fsdp else 0
                        for u in units},
        gathered=gathered, block_plan=plan, head_saved=head_saved_bytes(s), autocast_copies=autocast_copies(layout, s),
        loss_transient=loss_transient_bytes(s), logits_grad=logits_grad_bytes(s),
        block_working=block_backward_working_bytes(s) + float8, optimizer_scratch=0 if offload else scratch,
        accumulating=run.n_microbatches > 1,
        reshard_after_forward=run.parallelism.fsdp_reshard_after_forward,
        block_units=tuple(u.name for u in plan_units if u.kind == "block"),
        embedding_unit=next((u.name for u in plan_units if u.kind == "embedding"), None),
        head_units=tuple(u.name for u in plan_units if u.kind in ("head", "root") and u.name in units),
    )
    moments = step_moments(sizes)

    sharding = sharding_text(layout)
    where = " (host: CPU offload)" if offload else ""
    mode = ac.mode if ac.mode != "selective" else f"selective {ac.selective_option}"
    kept = [k for k, _ in plan]
    terms = [
        MemoryTerm("parameters", params, f"fp32 master weights, {sharding}{where}"),
        MemoryTerm("optimizer states", states, optimizer_text(low_bit) + where),
        MemoryTerm("buffers", layout.buffer_bytes, "fp32 rotary table, replicated"),
        MemoryTerm("gradients", sum(grads.values()), f"fp32, {sharding}{where}"),
        MemoryTerm("optimizer step scratch", sizes.optimizer_scratch, scratch_how),
        MemoryTerm("activations", sum(kept),
                   f"AC {mode}: {len(kept)} blocks x {mib(max(kept))} max, {s.tokens} tokens/micro-batch, "
                   f"{param_bytes}-byte compute"),
        MemoryTerm("head activations", sizes.head_saved, "final norm + output projection input"),
        MemoryTerm("loss transient", sizes.loss_transient,
                   "compiled: logits + their gradient" if s.compiled_loss else "fp32 log-probs + 2 fp32 gradients"),
        MemoryTerm("block backward transient", max(r for _, r in plan) + sizes.block_working,
                   "recomputed activations (AC) + activation gradients of one block"),
        *moe_terms(layout, s, low_bit),
        MemoryTerm("FSDP gathered params", max(m.parts.get("FSDP gathered", 0) for m in moments),
                   gathered_text(run, fsdp, layout)),
        MemoryTerm("autocast weight copies", sizes.autocast_copies,
                   f"{param_bytes}-byte copy of each non-float8 Linear weight" if s.autocast else "no autocast"),
        MemoryTerm("float8 casts", float8, "float8 operands of the largest converted Linear" if float8
                   else "no float8 Linears"),
    ]
    if device_type == "cuda":
        terms.append(MemoryTerm("CUDA context", CUDA_CONTEXT_BYTES, "outside the caching allocator (constant)"))
    return MemoryEstimate(terms=tuple(terms), moments=tuple(moments),
                          layout=f"{dims.describe()} (world size {world_size})", device_type=device_type,
                          world_size=world_size, model=layout.counts.describe() if layout.counts else "",
                          all_gather=layout.all_gather_text)
