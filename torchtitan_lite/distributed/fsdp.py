"""FSDP2 (`fully_shard`) over a family's plan: one unit per block, the embedding, the head (final norm +
output projection), the root.

Gradients are SUMMED over data-parallel ranks (divide factor 1): the training loop already divides each
micro-batch loss by the token count of the whole global step, so averaging here would divide twice.
"""
from __future__ import annotations

import logging
from typing import Literal

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard

from torchtitan_lite.protocols.model_spec import ParallelPlan
from torchtitan_lite.protocols.module_names import submodule

logger = logging.getLogger(__name__)

ReshardPolicy = Literal["default", "always", "never"]


def apply_fsdp(
    model: nn.Module,
    fsdp_mesh: DeviceMesh,
    plan: ParallelPlan,
    *,
    mp_policy: MixedPrecisionPolicy | None = None,
    reshard_after_forward: ReshardPolicy = "default",
    cpu_offload: bool = False,
    expert_mesh: DeviceMesh | None = None,
) -> nn.Module:
    """Shard `model` in place over `fsdp_mesh` (1-D: FSDP; 2-D (replicate, shard): HSDP); returns it.

    expert_mesh: under expert parallelism, the mesh the routed experts of each block (``plan.experts``,
    already EP-sharded) are sharded over instead: their own FSDP unit inside the block's. Their gradients
    are then summed over that mesh only; the all-to-all's backward has already brought every EP rank's
    contribution to the expert's owner.

    reshard_after_forward: 'always' frees every unit's gathered parameters after its forward (re-gathered
    in backward), 'never' keeps them (ZeRO-2-like memory, no backward all-gather), 'default' reshards all
    blocks but the last one and keeps the head, whose parameters backward needs immediately.
    """
    if cpu_offload and fsdp_mesh.device_type != "cuda":
        raise ValueError(
            f"parallelism.fsdp_cpu_offload=true needs CUDA, but the mesh is on {fsdp_mesh.device_type!r}: on a "
            "CPU-only run parameters already live in host memory; set parallelism.fsdp_cpu_offload=false"
        )
    if reshard_after_forward not in ("default", "always", "never"):
        raise ValueError(
            f"parallelism.fsdp_reshard_after_forward={reshard_after_forward!r} must be 'default', 'always' or 'never'"
        )
    policy = mp_policy or MixedPrecisionPolicy()
    offload = CPUOffloadPolicy() if cpu_offload else OffloadPolicy()

    def shard(modules: nn.Module | list[nn.Module], reshard: bool, mesh: DeviceMesh = fsdp_mesh) -> None:
        fully_shard(modules, mesh=mesh, reshard_after_forward=reshard, mp_policy=policy, offload_policy=offload)

    always = reshard_after_forward == "always"
    never = reshard_after_forward == "never"

    blocks = dict(getattr(model, plan.blocks).items())
    # A pipeline stage holds the embedding only if first, the head only if last (None otherwise).
    embedding, output = getattr(model, plan.embedding), getattr(model, plan.output)
    tied = embedding is not None and output is not None and output.weight is embedding.weight
    experts = {key: m for key, block in blocks.items()
               if (m := _block_experts(block, plan)) is not None} if expert_mesh is not None else {}
    last_block = next(reversed(blocks), None)
    for unit in plan.fsdp_units(list(blocks), first=embedding is not None, last=output is not None, tied=tied,
                                expert_blocks=experts):
        if unit.kind == "embedding":
            shard(model.get_submodule(unit.modules[0]), not never)
        elif unit.kind in ("experts", "block"):
            assert unit.block is not None
            reshard = always or (not never and unit.block != last_block)
            if unit.kind == "experts":
                shard(experts[unit.block], reshard, expert_mesh or fsdp_mesh)
            else:
                shard(blocks[unit.block], reshard)
        elif unit.kind == "head":
            shard([model.get_submodule(m) for m in unit.modules], always)
        else:
            shard(model, always)

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            # Plain SUM collectives (no PREMUL_SUM / AVG), which gloo supports and NCCL runs zero-copy.
            module.set_force_sum_reduction_for_comms(True)
    if fsdp_mesh.device_type == "cpu":
        from torchtitan_lite.distributed.float8_allgather import use_byte_view_all_gather

        use_byte_view_all_gather(model)
    kind = f"HSDP {tuple(fsdp_mesh.shape)}" if fsdp_mesh.ndim == 2 else f"FSDP {fsdp_mesh.size()}"
    if expert_mesh is not None:
        kind += f" (experts over {'x'.join(map(str, expert_mesh.shape))} rank(s) of {expert_mesh.mesh_dim_names})"
    logger.info("applied %s: %d blocks, reshard_after_forward=%s, param_dtype=%s, reduce_dtype=%s%s", kind,
                len(blocks), reshard_after_forward, policy.param_dtype, policy.reduce_dtype, ", CPU offload" if cpu_offload else "")
    return model


def _block_experts(block: nn.Module, plan: ParallelPlan) -> nn.Module | None:
    """The block's routed experts by the plan's block-relative name, through an activation-checkpoint wrapper;
    None for a block without them (a dense block of a family whose first blocks have no experts)."""
    if plan.experts is None:
        raise ValueError("an expert mesh was given but the family's plan names no experts (ParallelPlan.experts)")
    return submodule(block, plan.experts)
