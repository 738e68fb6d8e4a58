"""The one parallelize sequence of every family: the family gives its plan as data, the run its layout.

Order: TP (float8 styles per communication region, sequence parallel, loss parallel; expert tensor parallelism
when the plan has an MoE part) -> expert parallelism -> context parallelism -> activation checkpointing ->
torch.compile per block -> FSDP2 / HSDP. TP must see the plain Linears to swap in DTensor parameters, and EP then
splits the TP-split experts over the (ep, tp) mesh; the layers that read the whole sequence learn their CP group
before checkpointing and compile wrap them (a recomputed block gathers its K/V again); checkpointing wraps the
parallelized block, and the MoE layers of a checkpointed block keep their token exchanges for its recomputation;
compile traces the checkpointed block (under EP only the regions between the all-to-alls, whose split sizes are
host integers); FSDP goes last so its all-gather / reduce-scatter hooks sit outside the compiled graphs. A dense
family's plan makes every MoE step a no-op. The layout rules are not repeated here: parallelize runs on a resolved
run, and ``resolve_run`` has already refused what the run cannot do.
"""
from __future__ import annotations

import logging

from torch import nn

from torchtitan_lite.distributed.activation_checkpoint import apply_ac
from torchtitan_lite.distributed.compile import apply_compile, expert_parallel_regions
from torchtitan_lite.distributed.context_parallel import apply_context_parallel
from torchtitan_lite.distributed.expert_parallel import apply_expert_parallel, keep_exchanges_for_recompute
from torchtitan_lite.distributed.fsdp import apply_fsdp
from torchtitan_lite.distributed.tensor_parallel import apply_tp
from torchtitan_lite.protocols.model import BaseModel
from torchtitan_lite.protocols.model_spec import ParallelPlan
from torchtitan_lite.protocols.parallelize import ParallelizeContext

logger = logging.getLogger(__name__)


def parallelize(model: BaseModel, plan: ParallelPlan, context: ParallelizeContext, *, label: str) -> BaseModel:
    """TP -> EP -> CP -> AC -> compile -> FSDP2 on ``model`` (on meta, meshes built) in place as ``plan`` and
    ``context`` say, then one log line 'parallelized <label>: ...' naming the layout; returns ``model``.

    Without data parallelism no FSDP is applied (the precision component then casts through autocast instead).
    """
    dims = context.parallel_dims
    blocks: nn.ModuleDict = getattr(model, plan.blocks)
    layouts = [dims.describe(), *_tp_words(model, plan, context)]
    expert_parallel = dims.ep_mesh is not None and plan.experts is not None
    if expert_parallel:
        assert dims.ep_mesh is not None
        apply_expert_parallel(blocks, dims.ep_mesh, dims.ep_tp_mesh)
        split = f"EP {dims.ep} x expert TP {dims.tp}" if dims.tp_enabled else f"EP {dims.ep}"
        layouts.append(f"experts split over {split}, FSDP-sharded over {dims.expert_fsdp_degree} rank(s)")
    if dims.cp_mesh is not None:
        apply_context_parallel(blocks, dims.cp_mesh.get_group())
        layouts.append(f"K/V all-gathered over CP, {2 * dims.cp} head-tail chunks per sequence")
    ac_config = context.activation_checkpoint
    ac = apply_ac(blocks, ac_config.mode, ac_config.selective_option,
                  compiled_tp=context.compile_model and dims.tp_enabled)
    keep_exchanges_for_recompute(blocks)
    layouts.append(f"AC {ac}")
    if context.compile_model and apply_compile(blocks, backend=context.compile_backend,
                                               fullgraph=context.compile_fullgraph,
                                               regions=expert_parallel_regions(plan) if expert_parallel else ()):
        what = "blocks but the expert all-to-all" if expert_parallel else "blocks"
        layouts.append(f"compiled {what} ({context.compile_backend})")
    if dims.fsdp_mesh is not None:
        apply_fsdp(model, dims.fsdp_mesh, plan, mp_policy=context.mp_policy,
                   reshard_after_forward=context.fsdp_reshard_after_forward, cpu_offload=context.fsdp_cpu_offload,
                   expert_mesh=dims.expert_fsdp_mesh)
    logger.info("parallelized %s: %s", label, ", ".join(layouts))
    return model


def _tp_words(model: BaseModel, plan: ParallelPlan, context: ParallelizeContext) -> list[str]:
    """``plan``'s TP applied to ``model`` when the run has TP; returns the layout words of the log line."""
    dims = context.parallel_dims
    if dims.tp_mesh is None:
        return []
    regions = apply_tp(model, dims.tp_mesh, plan, sequence_parallel=context.sequence_parallel,
                       loss_parallel=context.loss_parallel)
    words = ["SP" if context.sequence_parallel else "no SP",
             "loss parallel" if context.loss_parallel else "replicated logits"]
    if plan.block_tp.moe is not None:
        words.append(f"expert TP {dims.tp}")
    float8 = sum(r.float8 for block in regions for r in block)
    if float8:
        words.append(f"float8 TP comms in {float8} of {sum(len(b) for b in regions)} regions")
    return words
