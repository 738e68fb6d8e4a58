"""DeepSeek-V3's parallel plan, as data, and the order in which the parallelisms are applied.

Today the family runs data-parallel (FSDP2 / HSDP over every parameter, the 3-D expert weights sharded on
their expert dim), with activation checkpointing and compile, in Llama 3's order. Tensor parallelism of
latent attention and expert parallelism of the MoE are not wired yet: a TP or EP degree above 1 is refused
(by --check-config and at build), so the plan holds no TP split.

Latent attention does not fit the Megatron split of one shared input feeding column-parallel Linears: its
input feeds the low-rank down-projections (wq_a, wkv_a), which TP would replicate, and the column-parallel
up-projections (wq_b, wkv_b) read their normalised outputs.
"""
from __future__ import annotations

import logging

import torch

from models.common.experts import GroupedExperts
from torchtitan_lite.protocols.model import BaseModel
from torchtitan_lite.protocols.model_spec import BlockTPPlan, ParallelPlan, RunFacts, build_tp_plan
from torchtitan_lite.protocols.parallelize import ParallelizeContext

logger = logging.getLogger(__name__)

DEEPSEEK_V3_PARALLEL_PLAN: ParallelPlan = build_tp_plan(
    BlockTPPlan(inputs=(), rowwise=(), norms=("attention_norm", "ffn_norm")),
    blocks="layers",
    embedding="tok_embeddings",
    output="output",
    final_norm="norm",
)


def parallelize_deepseek_v3(model: BaseModel, context: ParallelizeContext) -> BaseModel:
    """AC -> compile -> FSDP2 on ``model`` (on meta, meshes built) as ``context`` says; returns it."""
    from torchtitan_lite.distributed.activation_checkpoint import apply_ac
    from torchtitan_lite.distributed.compile import apply_compile
    from torchtitan_lite.distributed.fsdp import apply_fsdp

    plan, dims = DEEPSEEK_V3_PARALLEL_PLAN, context.parallel_dims
    check_degrees(dims.tp, dims.ep)
    # Also checked by resolve_run (check_deepseek_v3_run); repeated on the built model for a caller that
    # parallelizes without resolving a run.
    grouped_mm = any(isinstance(m, GroupedExperts) and m.use_grouped_mm for m in model.modules())
    check_compile_dtype(grouped_mm, context.compile_model, context.mp_policy.param_dtype)
    layouts = [dims.describe()]
    ac = apply_ac(model, context.activation_checkpoint.mode, context.activation_checkpoint.selective_option,
                  compiled_tp=False)
    layouts.append(f"AC {ac}")
    if apply_compile(model, context.compile):
        layouts.append(f"compiled blocks ({context.compile.backend})")
    if dims.fsdp_mesh is not None:
        apply_fsdp(model, dims.fsdp_mesh, plan, mp_policy=context.mp_policy,
                   reshard_after_forward=context.fsdp_reshard_after_forward, cpu_offload=context.fsdp_cpu_offload)
    logger.info("parallelized deepseek_v3: %s", ", ".join(layouts))
    return model


def check_deepseek_v3_run(facts: RunFacts) -> None:
    """The family's rules on a resolved run (ModelSpec.check_run): refused before launch by --check-config."""
    check_degrees(facts.tp, facts.ep)
    check_compile_dtype(facts.model_args.moe.use_grouped_mm, facts.compile_model, facts.param_dtype)


def check_degrees(tp: int, ep: int) -> None:
    """ValueError for the parallelisms the family has no plan for yet."""
    if tp > 1:
        raise ValueError(f"deepseek_v3 does not support tensor parallelism yet (parallelism.tp={tp}): latent "
                         "attention and the MoE have no TP plan; set --parallelism.tp 1 and shard with FSDP "
                         "(parallelism.dp_shard)")
    if ep > 1:
        raise ValueError(f"deepseek_v3 does not support expert parallelism yet (parallelism.ep={ep}); set "
                         "--parallelism.ep 1: FSDP (parallelism.dp_shard) shards the experts along their expert dim")


def check_compile_dtype(grouped_mm: bool, compile_model: bool, compute_dtype: torch.dtype | None) -> None:
    """torch._grouped_mm runs in any float dtype eagerly, but its traced (meta) form in torch 2.13 accepts only
    bfloat16 operands: a compiled float32 / float16 model would fail inside the compiler."""
    if compile_model and grouped_mm and compute_dtype not in (None, torch.bfloat16):
        raise ValueError(
            f"compiling grouped MoE experts needs bfloat16 compute, but precision.param_dtype is "
            f"{str(compute_dtype).removeprefix('torch.')} (torch._grouped_mm is traced for bfloat16 only); set "
            "--precision.param_dtype bfloat16 or --compile.enable false")
