"""Llama 3's parallel plan, as data, and the order in which the parallelisms are applied.

The plan (``LLAMA3_PARALLEL_PLAN``) is the one place that says which Linear TP splits how and what the FSDP
units are; the trainer's parallelize step, the memory estimate and the dry run all read it.

Order: TP (float8 styles per communication region, sequence parallel, loss parallel) -> activation
checkpointing -> torch.compile per block -> FSDP2 / HSDP. TP must see the plain Linears to swap in DTensor
parameters; checkpointing wraps the TP'd block; compile traces the checkpointed block; FSDP goes last so
its all-gather / reduce-scatter hooks sit outside the compiled graphs.
"""
from __future__ import annotations

import logging

from torchtitan_lite.protocols.model import BaseModel
from torchtitan_lite.protocols.model_spec import BlockTPPlan, ParallelPlan, TPInput, build_tp_plan
from torchtitan_lite.protocols.parallelize import ParallelizeContext

logger = logging.getLogger(__name__)

LLAMA3_PARALLEL_PLAN: ParallelPlan = build_tp_plan(
    BlockTPPlan(
        inputs=(
            # attention(x, rope_cache): the rotary table passes through whole.
            TPInput("attention", ("attention.wq", "attention.wk", "attention.wv"), "attention input", n_inputs=2),
            TPInput("feed_forward", ("feed_forward.w1", "feed_forward.w3"), "feed_forward input"),
        ),
        rowwise=("attention.wo", "feed_forward.w2"),
        norms=("attention_norm", "ffn_norm"),
    ),
    blocks="layers",
    embedding="tok_embeddings",
    output="output",
    final_norm="norm",
)


def parallelize_llama(model: BaseModel, context: ParallelizeContext) -> BaseModel:
    """Parallelize ``model`` (on meta, meshes built) in place as ``context`` says; returns it.

    Without data parallelism no FSDP is applied (the precision component then casts through autocast instead).
    """
    from torchtitan_lite.distributed.activation_checkpoint import apply_ac
    from torchtitan_lite.distributed.compile import apply_compile
    from torchtitan_lite.distributed.fsdp import apply_fsdp
    from torchtitan_lite.distributed.tensor_parallel import apply_tp

    plan, dims = LLAMA3_PARALLEL_PLAN, context.parallel_dims
    layouts = [dims.describe()]
    if dims.tp_mesh is not None:
        regions = apply_tp(model, dims.tp_mesh, plan, sequence_parallel=context.sequence_parallel,
                           loss_parallel=context.loss_parallel)
        layouts.append("SP" if context.sequence_parallel else "no SP")
        layouts.append("loss parallel" if context.loss_parallel else "replicated logits")
        float8 = sum(r.float8 for block in regions for r in block)
        if float8:
            layouts.append(f"float8 TP comms in {float8} of {sum(len(b) for b in regions)} regions")

    ac = apply_ac(model, context.activation_checkpoint.mode, context.activation_checkpoint.selective_option,
                  compiled_tp=context.compile_model and dims.tp_enabled)
    layouts.append(f"AC {ac}")

    if context.compile_model and apply_compile(model, backend=context.compile_backend,
                                               fullgraph=context.compile_fullgraph):
        layouts.append(f"compiled blocks ({context.compile_backend})")

    if dims.fsdp_mesh is not None:
        apply_fsdp(model, dims.fsdp_mesh, plan, mp_policy=context.mp_policy,
                   reshard_after_forward=context.fsdp_reshard_after_forward, cpu_offload=context.fsdp_cpu_offload)

    logger.info("parallelized llama3: %s", ", ".join(layouts))
    return model
