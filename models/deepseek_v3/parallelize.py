"""DeepSeek-V3's parallel plan, as data, and the order in which the parallelisms are applied.

The family runs data-parallel (FSDP2 / HSDP over every parameter, the 3-D expert weights sharded on their
expert dim) and expert-parallel (parallelism.ep: the routed experts of every MoE block split over the EP
ranks with all-to-all token dispatch, models/common/expert_parallel.py, and FSDP-sharded over the ranks left,
expert_fsdp_mesh; the dense first blocks, the shared experts, the routers and their expert biases are
data-parallel as without EP), with activation checkpointing and compile. Order: EP -> activation
checkpointing -> compile -> FSDP. Tensor parallelism of latent attention is not wired yet: a TP degree
above 1 is refused (by --check-config and at build), so the plan holds no TP split.

Latent attention does not fit the Megatron split of one shared input feeding column-parallel Linears: its
input feeds the low-rank down-projections (wq_a, wkv_a), which TP would replicate, and the column-parallel
up-projections (wq_b, wkv_b) read their normalised outputs.
"""
from __future__ import annotations

import logging

import torch

from models.common.expert_parallel import apply_expert_parallel, check_expert_parallel, keep_exchanges_for_recompute
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
    experts="moe.experts",
)

EP_COMPILE_REGIONS = ("attention_norm", "attention", "ffn_norm", "moe.router", "moe.experts", "moe.shared_experts")
"""What is compiled of an MoE block under expert parallelism: everything but the MoE layer's dispatch and
combine, whose all-to-all split sizes are host integers (a whole-block graph would break there). A dense
block is compiled whole."""


def ep_compile_regions(block: torch.nn.Module) -> tuple[str, ...]:
    """EP_COMPILE_REGIONS for an MoE block, () (the whole block) for a dense one."""
    return EP_COMPILE_REGIONS if any(isinstance(m, GroupedExperts) for m in block.modules()) else ()


def parallelize_deepseek_v3(model: BaseModel, context: ParallelizeContext) -> BaseModel:
    """EP -> AC -> compile -> FSDP2 on ``model`` (on meta, meshes built) as ``context`` says; returns it."""
    from torchtitan_lite.distributed.activation_checkpoint import apply_ac
    from torchtitan_lite.distributed.compile import apply_compile
    from torchtitan_lite.distributed.fsdp import apply_fsdp

    plan, dims = DEEPSEEK_V3_PARALLEL_PLAN, context.parallel_dims
    # Also checked by resolve_run (check_deepseek_v3_run); repeated on the built model for a caller that
    # parallelizes without resolving a run.
    check_degrees(dims.tp)
    experts = [m for m in model.modules() if isinstance(m, GroupedExperts)]
    check_compile_dtype(any(m.use_grouped_mm for m in experts), context.compile_model, context.mp_policy.param_dtype)
    ac_config = context.activation_checkpoint
    layouts = [dims.describe()]
    if dims.ep_mesh is not None:
        check_expert_parallel(experts[0].num_experts, dims.ep, ac_config.mode, ac_config.selective_option)
        apply_expert_parallel(model, dims.ep_mesh)
        layouts.append(f"experts split over EP {dims.ep}, FSDP-sharded over {dims.expert_fsdp_degree} rank(s)")
    ac = apply_ac(model, ac_config.mode, ac_config.selective_option, compiled_tp=False)
    keep_exchanges_for_recompute(model.layers)
    layouts.append(f"AC {ac}")
    if apply_compile(model, context.compile, ep_compile_regions if dims.ep_mesh is not None else ()):
        what = "blocks but the expert all-to-all" if dims.ep_mesh is not None else "blocks"
        layouts.append(f"compiled {what} ({context.compile.backend})")
    if dims.fsdp_mesh is not None:
        apply_fsdp(model, dims.fsdp_mesh, plan, mp_policy=context.mp_policy,
                   reshard_after_forward=context.fsdp_reshard_after_forward, cpu_offload=context.fsdp_cpu_offload,
                   expert_mesh=dims.expert_fsdp_mesh)
    logger.info("parallelized deepseek_v3: %s", ", ".join(layouts))
    return model


def check_deepseek_v3_run(facts: RunFacts) -> None:
    """The family's rules on a resolved run (ModelSpec.check_run): refused before launch by --check-config."""
    moe = facts.model_args.moe
    check_degrees(facts.tp)
    check_compile_dtype(moe.use_grouped_mm, facts.compile_model, facts.param_dtype)
    check_expert_parallel(moe.num_experts, facts.ep, facts.ac_mode, facts.ac_selective_option)


def check_degrees(tp: int) -> None:
    """ValueError for the parallelism the family has no plan for yet."""
    if tp > 1:
        raise ValueError(f"deepseek_v3 does not support tensor parallelism yet (parallelism.tp={tp}): latent "
                         "attention and the MoE have no TP plan; set --parallelism.tp 1 and shard with FSDP "
                         "(parallelism.dp_shard), and split the experts with expert parallelism (parallelism.ep)")


def check_compile_dtype(grouped_mm: bool, compile_model: bool, compute_dtype: torch.dtype | None) -> None:
    """torch._grouped_mm runs in any float dtype eagerly, but its traced (meta) form in torch 2.13 accepts only
    bfloat16 operands: a compiled float32 / float16 model would fail inside the compiler."""
    if compile_model and grouped_mm and compute_dtype not in (None, torch.bfloat16):
        raise ValueError(
            f"compiling grouped MoE experts needs bfloat16 compute, but precision.param_dtype is "
            f"{str(compute_dtype).removeprefix('torch.')} (torch._grouped_mm is traced for bfloat16 only); set "
            "--precision.param_dtype bfloat16 or --compile.enable false")
