"""What every MoE family does after its own tensor-parallel step: expert parallelism, activation
checkpointing, compile and FSDP2, in that order, and the compile rule of the grouped experts.

A family's parallelize function applies its TP plan (if it has one), then hands the model to
``apply_moe_parallelisms`` with its plan and the compile regions its blocks need under EP. The layout rules are
not repeated here: parallelize runs on a resolved run, and ``resolve_run`` has already refused what the experts
cannot run (expert parallelism in its check_expert_parallel, the family's rules below in its check_run).
"""
from __future__ import annotations

import logging
from collections.abc import Callable

import torch
from torch import nn

from models.common.expert_parallel import apply_expert_parallel, keep_exchanges_for_recompute
from torchtitan_lite.protocols.model import BaseModel
from torchtitan_lite.protocols.model_spec import ParallelPlan
from torchtitan_lite.protocols.parallelize import ParallelizeContext

logger = logging.getLogger(__name__)

CompileRegions = tuple[str, ...] | Callable[[nn.Module], tuple[str, ...]]


def apply_moe_parallelisms(model: BaseModel, context: ParallelizeContext, plan: ParallelPlan, *, family: str,
                           layouts: list[str], ep_compile_regions: CompileRegions) -> BaseModel:
    """EP -> AC -> compile -> FSDP2 on ``model`` (its TP, if any, already applied), then one log line naming
    ``layouts`` plus what was applied here. ``ep_compile_regions``: what apply_compile compiles of each block
    under EP (everything but the dispatch / combine, whose all-to-all split sizes are host integers)."""
    from torchtitan_lite.distributed.activation_checkpoint import apply_ac
    from torchtitan_lite.distributed.compile import apply_compile
    from torchtitan_lite.distributed.fsdp import apply_fsdp

    dims, ac_config = context.parallel_dims, context.activation_checkpoint
    if dims.ep_mesh is not None:
        apply_expert_parallel(model, dims.ep_mesh, dims.ep_tp_mesh)
        split = f"EP {dims.ep} x expert TP {dims.tp}" if dims.tp_enabled else f"EP {dims.ep}"
        layouts.append(f"experts split over {split}, FSDP-sharded over {dims.expert_fsdp_degree} rank(s)")
    ac = apply_ac(model, ac_config.mode, ac_config.selective_option,
                  compiled_tp=context.compile_model and dims.tp_enabled)
    keep_exchanges_for_recompute(model.layers)
    layouts.append(f"AC {ac}")
    if context.compile_model and apply_compile(model, backend=context.compile_backend,
                                               fullgraph=context.compile_fullgraph,
                                               regions=ep_compile_regions if dims.ep_mesh is not None else ()):
        what = "blocks but the expert all-to-all" if dims.ep_mesh is not None else "blocks"
        layouts.append(f"compiled {what} ({context.compile_backend})")
    if dims.fsdp_mesh is not None:
        apply_fsdp(model, dims.fsdp_mesh, plan, mp_policy=context.mp_policy,
                   reshard_after_forward=context.fsdp_reshard_after_forward, cpu_offload=context.fsdp_cpu_offload,
                   expert_mesh=dims.expert_fsdp_mesh)
    logger.info("parallelized %s: %s", family, ", ".join(layouts))
    return model


def apply_moe_tp(model: BaseModel, context: ParallelizeContext, plan: ParallelPlan) -> list[str]:
    """The family's TP plan applied to ``model`` when the run has TP (the family's check_run has checked the
    experts' hidden dim split); returns the layout words of the log line."""
    from torchtitan_lite.distributed.tensor_parallel import apply_tp

    dims = context.parallel_dims
    layouts = [dims.describe()]
    if dims.tp_mesh is None:
        return layouts
    regions = apply_tp(model, dims.tp_mesh, plan, sequence_parallel=context.sequence_parallel,
                       loss_parallel=context.loss_parallel)
    layouts.append("SP" if context.sequence_parallel else "no SP")
    layouts.append("loss parallel" if context.loss_parallel else "replicated logits")
    layouts.append(f"expert TP {dims.tp}")
    float8 = sum(r.float8 for block in regions for r in block)
    if float8:
        layouts.append(f"float8 TP comms in {float8} of {sum(len(b) for b in regions)} regions")
    return layouts


def check_expert_tp(hidden_dim: int, tp: int, grouped_mm: bool) -> None:
    """Expert tensor parallelism splits every expert's (and each shared expert's) hidden dim over the tp ranks:
    it must divide, and under torch._grouped_mm each slice must keep its 16-byte aligned strides."""
    if hidden_dim % tp:
        raise ValueError(
            f"parallelism.tp={tp} must divide the MoE experts' hidden_dim={hidden_dim} (expert tensor parallelism "
            f"gives each rank hidden_dim / tp channels of every expert); use a tp among the divisors of "
            f"{hidden_dim}, or data parallelism (parallelism.dp_shard) instead")
    if grouped_mm and (hidden_dim // tp) % 8:
        raise ValueError(
            f"parallelism.tp={tp} leaves each rank {hidden_dim // tp} of the experts' hidden_dim={hidden_dim} "
            "channels, not a multiple of 8: torch._grouped_mm needs 16-byte aligned strides in bfloat16; use a "
            "smaller tp, or set the flavor's moe.use_grouped_mm=False to run the per-expert loop")


def check_grouped_mm_compile_dtype(grouped_mm: bool, compile_model: bool, compute_dtype: torch.dtype | None) -> None:
    """torch._grouped_mm runs in any float dtype eagerly, but its traced (meta) form in torch 2.13 accepts only
    bfloat16 operands: a compiled float32 / float16 model would fail inside the compiler."""
    if compile_model and grouped_mm and compute_dtype not in (None, torch.bfloat16):
        raise ValueError(
            f"compiling grouped MoE experts needs bfloat16 compute, but precision.param_dtype is "
            f"{str(compute_dtype).removeprefix('torch.')} (torch._grouped_mm is traced for bfloat16 only); set "
            "--precision.param_dtype bfloat16 or --compile.enable false")
