"""Qwen3-MoE's parallel plan, as data, and the order in which the parallelisms are applied.

Today the family runs data-parallel (FSDP2 / HSDP over every parameter, the 3-D expert weights sharded on
their expert dim), with activation checkpointing and compile, in Llama 3's order. Tensor parallelism of
the attention and expert parallelism of the MoE are not wired yet, so a TP degree is refused here.
"""
from __future__ import annotations

import logging

import torch

from models.common.experts import GroupedExperts
from torchtitan_lite.protocols.model import BaseModel
from torchtitan_lite.protocols.model_spec import BlockTPPlan, ParallelPlan, RunFacts, TPInput, build_tp_plan
from torchtitan_lite.protocols.parallelize import ParallelizeContext

logger = logging.getLogger(__name__)

QWEN3_MOE_PARALLEL_PLAN: ParallelPlan = build_tp_plan(
    BlockTPPlan(
        inputs=(TPInput("attention", ("attention.wq", "attention.wk", "attention.wv"), "attention input", n_inputs=2),),
        rowwise=("attention.wo",),
        norms=("attention_norm", "ffn_norm"),
    ),
    blocks="layers",
    embedding="tok_embeddings",
    output="output",
    final_norm="norm",
)


def parallelize_qwen3_moe(model: BaseModel, context: ParallelizeContext) -> BaseModel:
    """AC -> compile -> FSDP2 on ``model`` (on meta, meshes built) as ``context`` says; returns it."""
    from torchtitan_lite.distributed.activation_checkpoint import apply_ac
    from torchtitan_lite.distributed.compile import apply_compile
    from torchtitan_lite.distributed.fsdp import apply_fsdp

    plan, dims = QWEN3_MOE_PARALLEL_PLAN, context.parallel_dims
    if dims.tp_mesh is not None:
        raise ValueError(f"qwen3_moe does not support tensor parallelism yet (parallelism.tp={dims.tp}): its MoE "
                         "feed-forward has no TP plan; set --parallelism.tp 1 and use data parallelism (dp_shard)")
    # Also checked by resolve_run (check_qwen3_moe_run); repeated on the built model for a caller that
    # parallelizes without resolving a run.
    grouped_mm = any(isinstance(m, GroupedExperts) and m.use_grouped_mm for m in model.modules())
    _check_compile_dtype(grouped_mm, context.compile_model, context.mp_policy.param_dtype)
    layouts = [dims.describe()]
    ac = apply_ac(model, context.activation_checkpoint.mode, context.activation_checkpoint.selective_option,
                  compiled_tp=False)
    layouts.append(f"AC {ac}")
    if apply_compile(model, context.compile):
        layouts.append(f"compiled blocks ({context.compile.backend})")
    if dims.fsdp_mesh is not None:
        apply_fsdp(model, dims.fsdp_mesh, plan, mp_policy=context.mp_policy,
                   reshard_after_forward=context.fsdp_reshard_after_forward, cpu_offload=context.fsdp_cpu_offload)
    logger.info("parallelized qwen3_moe: %s", ", ".join(layouts))
    return model


def check_qwen3_moe_run(facts: RunFacts) -> None:
    """The family's rules on a resolved run (ModelSpec.check_run): refused before launch by --check-config."""
    _check_compile_dtype(facts.model_args.moe.use_grouped_mm, facts.compile_model, facts.param_dtype)


def _check_compile_dtype(grouped_mm: bool, compile_model: bool, compute_dtype: torch.dtype | None) -> None:
    """torch._grouped_mm runs in any float dtype eagerly, but its traced (meta) form in torch 2.13 accepts only
    bfloat16 operands: a compiled float32 / float16 model would fail inside the compiler."""
    if compile_model and grouped_mm and compute_dtype not in (None, torch.bfloat16):
        raise ValueError(
            f"compiling grouped MoE experts needs bfloat16 compute, but precision.param_dtype is "
            f"{str(compute_dtype).removeprefix('torch.')} (torch._grouped_mm is traced for bfloat16 only); set "
            "--precision.param_dtype bfloat16 or --compile.enable false")
