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

import torch

from models.common.expert_parallel import check_expert_parallel
from models.common.experts import GroupedExperts
from models.common.moe_parallelize import apply_moe_parallelisms, check_grouped_mm_compile_dtype
from torchtitan_lite.protocols.model import BaseModel
from torchtitan_lite.protocols.model_spec import BlockTPPlan, ParallelPlan, RunFacts, build_tp_plan
from torchtitan_lite.protocols.parallelize import ParallelizeContext

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
    dims = context.parallel_dims
    check_degrees(dims.tp)  # also checked by resolve_run (check_deepseek_v3_run)
    return apply_moe_parallelisms(model, context, DEEPSEEK_V3_PARALLEL_PLAN, family="deepseek_v3",
                                  layouts=[dims.describe()], ep_compile_regions=ep_compile_regions)


def check_deepseek_v3_run(facts: RunFacts) -> None:
    """The family's rules on a resolved run (ModelSpec.check_run): refused before launch by --check-config."""
    moe = facts.model_args.moe
    check_degrees(facts.tp)
    check_grouped_mm_compile_dtype(moe.use_grouped_mm, facts.compile_model, facts.param_dtype)
    check_expert_parallel(moe.num_experts, facts.ep, facts.ac_mode, facts.ac_selective_option)


def check_degrees(tp: int) -> None:
    """ValueError for the parallelism the family has no plan for yet."""
    if tp > 1:
        raise ValueError(f"deepseek_v3 does not support tensor parallelism yet (parallelism.tp={tp}): latent "
                         "attention and the MoE have no TP plan; set --parallelism.tp 1 and shard with FSDP "
                         "(parallelism.dp_shard), and split the experts with expert parallelism (parallelism.ep)")
