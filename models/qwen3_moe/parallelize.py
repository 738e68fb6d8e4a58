"""Qwen3-MoE's parallel plan, as data, and the order in which the parallelisms are applied.

The family runs data-parallel (FSDP2 / HSDP over every parameter, the 3-D expert weights sharded on
their expert dim) with optional expert parallelism, activation checkpointing and compile, in the order
EP -> AC -> compile -> FSDP. Under EP (parallelism.ep) the experts are split over the EP ranks with
all-to-all token dispatch, and FSDP shards them over the ranks left (expert_fsdp_mesh); every other
parameter is sharded over dp_shard as without EP. Tensor parallelism is not wired yet, so a TP degree is
refused here.
"""
from __future__ import annotations

import logging

import torch

from models.common.expert_parallel import apply_expert_parallel, keep_exchanges_for_recompute
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
    experts="moe.experts",
)

EP_COMPILE_REGIONS = ("attention_norm", "attention", "ffn_norm", "moe.router", "moe.experts")
"""What is compiled of each block under expert parallelism: everything but the MoE layer's dispatch and
combine, whose all-to-all split sizes are host integers (a whole-block graph would break there)."""


def parallelize_qwen3_moe(model: BaseModel, context: ParallelizeContext) -> BaseModel:
    """EP -> AC -> compile -> FSDP2 on ``model`` (on meta, meshes built) as ``context`` says; returns it."""
    from torchtitan_lite.distributed.activation_checkpoint import apply_ac
    from torchtitan_lite.distributed.compile import apply_compile
    from torchtitan_lite.distributed.fsdp import apply_fsdp

    plan, dims = QWEN3_MOE_PARALLEL_PLAN, context.parallel_dims
    if dims.tp_mesh is not None:
        raise ValueError(f"qwen3_moe does not support tensor parallelism yet (parallelism.tp={dims.tp}): its MoE "
                         "feed-forward has no TP plan; set --parallelism.tp 1 and use data parallelism (dp_shard)")
    # Also checked by resolve_run (check_qwen3_moe_run); repeated on the built model for a caller that
    # parallelizes without resolving a run.
    experts = [m for m in model.modules() if isinstance(m, GroupedExperts)]
    grouped_mm = any(m.use_grouped_mm for m in experts)
    _check_compile_dtype(grouped_mm, context.compile_model, context.mp_policy.param_dtype)
    layouts = [dims.describe()]
    ac_config = context.activation_checkpoint
    if dims.ep_mesh is not None:
        _check_expert_parallel(experts[0].num_experts, dims.ep, dims.tp, ac_config.mode, ac_config.selective_option)
        apply_expert_parallel(model, dims.ep_mesh)
        layouts.append(f"experts split over EP {dims.ep}, FSDP-sharded over {dims.expert_fsdp_degree} rank(s)")
    ac = apply_ac(model, ac_config.mode, ac_config.selective_option, compiled_tp=False)
    keep_exchanges_for_recompute(model.layers)
    layouts.append(f"AC {ac}")
    if apply_compile(model, context.compile, EP_COMPILE_REGIONS if dims.ep_mesh is not None else ()):
        what = "blocks but the expert all-to-all" if dims.ep_mesh is not None else "blocks"
        layouts.append(f"compiled {what} ({context.compile.backend})")
    if dims.fsdp_mesh is not None:
        apply_fsdp(model, dims.fsdp_mesh, plan, mp_policy=context.mp_policy,
                   reshard_after_forward=context.fsdp_reshard_after_forward, cpu_offload=context.fsdp_cpu_offload,
                   expert_mesh=dims.expert_fsdp_mesh)
    logger.info("parallelized qwen3_moe: %s", ", ".join(layouts))
    return model


def check_qwen3_moe_run(facts: RunFacts) -> None:
    """The family's rules on a resolved run (ModelSpec.check_run): refused before launch by --check-config."""
    _check_compile_dtype(facts.model_args.moe.use_grouped_mm, facts.compile_model, facts.param_dtype)
    _check_expert_parallel(facts.model_args.moe.num_experts, facts.ep, facts.tp, facts.ac_mode, facts.ac_selective_option)


def _check_expert_parallel(num_experts: int, ep: int, tp: int, ac_mode: str, ac_selective_option: str) -> None:
    if ep == 1:
        return
    if num_experts % ep:
        divisors = [d for d in range(1, num_experts + 1) if num_experts % d == 0]
        raise ValueError(
            f"parallelism.ep={ep} must divide the model's num_experts={num_experts} (every EP rank holds the same "
            f"number of experts); use an ep among {divisors}")
    if tp > 1:
        raise ValueError(
            f"qwen3_moe does not support expert parallelism together with tensor parallelism yet (parallelism.ep={ep}, "
            f"parallelism.tp={tp}); set --parallelism.tp 1, or --parallelism.ep 1")
    if ac_mode == "selective" and ac_selective_option == "op":
        # torch 2.13's selective checkpointing replays ops by count, and the experts' own FSDP unit inside the
        # block runs its all-gather hooks a different number of times in the recomputation.
        raise ValueError(
            f"activation_checkpoint.mode=selective with selective_option=op does not work with expert parallelism "
            f"(parallelism.ep={ep}) on this PyTorch: per-op checkpointing cannot replay the experts' FSDP hooks; use "
            "--activation_checkpoint.mode full, or --activation_checkpoint.selective_option 2 (every 2nd block)")


def _check_compile_dtype(grouped_mm: bool, compile_model: bool, compute_dtype: torch.dtype | None) -> None:
    """torch._grouped_mm runs in any float dtype eagerly, but its traced (meta) form in torch 2.13 accepts only
    bfloat16 operands: a compiled float32 / float16 model would fail inside the compiler."""
    if compile_model and grouped_mm and compute_dtype not in (None, torch.bfloat16):
        raise ValueError(
            f"compiling grouped MoE experts needs bfloat16 compute, but precision.param_dtype is "
            f"{str(compute_dtype).removeprefix('torch.')} (torch._grouped_mm is traced for bfloat16 only); set "
            "--precision.param_dtype bfloat16 or --compile.enable false")
