"""Tensor parallelism (Megatron column/row split), sequence parallelism and vocab-parallel loss: the
mechanics, applied to whatever plan a model family states (``ParallelPlan``, models/<family>/parallelize.py).

Plan per block: the Linears that read a shared input are split by output columns, the output projections
by input rows, so each input region needs one all-gather in and each output projection one
reduce(-scatter) out. With sequence parallelism the norms and the residual stream between blocks are
sharded along the sequence (Shard(1)), turning the all-reduce into reduce-scatter + all-gather. With loss
parallelism the logits stay sharded by vocabulary (Shard(-1)) and cross-entropy runs on the shards.

Float8 communication is decided per region, not per block: a shared input is cast to float8 before its
all-gather exactly when every Linear that consumes it is a torchao tensorwise Float8Linear (otherwise a
high-precision consumer would receive float8 data), and an output projection uses torchao's float8
row-wise style when it is itself tensorwise float8 (its output-gradient all-gather then moves float8).
Row-wise float8 recipes keep the plain styles: their per-row scales cannot be gathered with the data.

An MoE feed-forward (``BlockTPPlan.moe``) is split by expert tensor parallelism
(expert_tensor_parallel.py): its input is gathered and its partial output reduce-scattered in high
precision, since the router reads that input in float32 and the experts' GEMMs are not float8 Linears.

Modules the plan replicates (``BlockTPPlan.replicated``: latent attention's down-projections and their norms,
replicated_modules.py) run whole on the gathered input; a region they read is gathered in high precision,
since they take no float8 TP style. The up-projections that read their outputs are column-parallel with
nothing to gather. Blocks that differ (dense and MoE feed-forwards) each apply the plan's entries they have.
"""
from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    loss_parallel,
    parallelize_module,
)
from torch.distributed.tensor.placement_types import Placement

from torchtitan_lite.distributed.expert_tensor_parallel import (
    ColwiseInPartialRegion,
    ExpertTensorParallel,
    GatheredRegion,
    ReplicatedRouter,
)
from torchtitan_lite.distributed.replicated_modules import ReplicatedInRegion
from torchtitan_lite.protocols.model_spec import BlockTPPlan, MoETPPlan, ParallelPlan

logger = logging.getLogger(__name__)

def is_float8_tensorwise(module: nn.Module) -> bool:
    """True for a torchao Float8Linear whose input, weight and output-gradient casts are all tensorwise."""
    from torchao.float8.config import ScalingGranularity
    from torchao.float8.float8_linear import Float8Linear

    if not isinstance(module, Float8Linear):
        return False
    casts = (module.config.cast_config_input, module.config.cast_config_weight,
             module.config.cast_config_grad_output)
    return all(c.scaling_granularity is ScalingGranularity.TENSORWISE for c in casts)


@dataclass(frozen=True)
class TPRegion:
    """One communication point of a block and whether it moves float8."""

    name: str
    """'attention input', 'attention.wo output', ..."""
    float8: bool
    why: str
    """Why it is (not) float8: the consumers that are not tensorwise float8, or the recipe."""


def tp_regions(plan: BlockTPPlan, is_float8_tensorwise_linear: Callable[[str], bool]) -> list[TPRegion]:
    """The communication regions of one block under ``plan``; ``is_float8_tensorwise_linear(fqn)`` says
    whether the block's Linear ``fqn`` is (or will be) a tensorwise Float8Linear."""
    regions = []
    for tp_input in plan.inputs:
        replicated = [fqn for fqn in tp_input.consumers if fqn in plan.replicated]
        hp = [fqn for fqn in tp_input.consumers if fqn not in plan.replicated and not is_float8_tensorwise_linear(fqn)]
        if replicated:
            why = f"{', '.join(replicated)} replicated"
        else:
            why = "every consumer is tensorwise float8" if not hp else f"{', '.join(hp)} not tensorwise float8"
        regions.append(TPRegion(tp_input.name, not hp and not replicated, why))
    for fqn in plan.rowwise:
        float8 = is_float8_tensorwise_linear(fqn)
        regions.append(TPRegion(f"{fqn} output", float8, "tensorwise float8" if float8 else "not tensorwise float8"))
    if plan.moe is not None:
        regions.append(TPRegion(f"{plan.moe.module} input", False, "the router reads it in float32"))
        regions.append(TPRegion(f"{plan.moe.module} output", False, "partial sums of the experts"))
    return regions


def _is_float8_in(block: nn.Module, fqn: str) -> bool:
    return is_float8_tensorwise(block.get_submodule(fqn))


def block_plan(plan: BlockTPPlan, block: nn.Module) -> BlockTPPlan:
    """``plan`` as it applies to ``block``: the entries whose modules the block has."""
    return plan.present_in({fqn for fqn, _ in block.named_modules()})


def tp_communication_text(plan: ParallelPlan, model: nn.Module, *, tp: int, high_precision: torch.dtype) -> str:
    """Each TP communication region of ``model``'s (converted, not yet parallelized) blocks: float8 or
    ``high_precision``, and why."""
    blocks = list(getattr(model, plan.blocks).values())
    by_name: dict[str, list[TPRegion]] = {}
    for block in blocks:
        for region in tp_regions(block_plan(plan.block_tp, block), partial(_is_float8_in, block)):
            by_name.setdefault(region.name, []).append(region)
    dtype = str(high_precision).removeprefix("torch.")
    lines = [f"TP {tp} communication per block ({len(blocks)} blocks):"]
    for name, regions in by_name.items():
        region = regions[0]
        same = sum(r.float8 == region.float8 for r in regions)
        where = "every block" if same == len(blocks) else f"{same} of {len(blocks)} blocks"
        moves = "float8" if region.float8 else dtype
        lines.append(f"  {name:<24} {moves:<9} ({region.why}; {where})")
    return "\n".join(lines)


def apply_tp(model: nn.Module, tp_mesh: DeviceMesh, plan: ParallelPlan, *, sequence_parallel: bool,
             loss_parallel: bool) -> list[list[TPRegion]]:
    """Parallelize ``model`` over ``tp_mesh`` in place per ``plan``; returns each block's regions."""
    if tp_mesh.device_type == "cpu":
        from torchtitan_lite.distributed.float8_allgather import enable_float8_tensor_all_gather_as_bytes

        enable_float8_tensor_all_gather_as_bytes()
    # Layout of the residual stream between TP regions: sharded along the sequence, or whole.
    residual = Shard(1) if sequence_parallel else Replicate()
    root_plan: dict[str, ParallelStyle] = {}
    # A pipeline stage holds the embedding only if first, the norm and head only if last (None otherwise).
    if getattr(model, plan.embedding) is not None:
        root_plan[plan.embedding] = _EmbeddingParallel(input_layouts=Replicate(), output_layouts=residual)
    if getattr(model, plan.output) is not None:
        root_plan[plan.output] = ColwiseParallel(
            input_layouts=residual,
            output_layouts=Shard(-1) if loss_parallel else Replicate(),
            use_local_output=not loss_parallel,
        )
        if sequence_parallel:
            root_plan[plan.final_norm] = SequenceParallel()
    if root_plan:
        parallelize_module(model, tp_mesh, root_plan)

    all_regions = []
    for block in getattr(model, plan.blocks).values():
        own = block_plan(plan.block_tp, block)
        regions = tp_regions(own, partial(_is_float8_in, block))
        all_regions.append(regions)
        parallelize_module(block, tp_mesh, _block_styles(own, regions, residual, sequence_parallel))
    float8 = sum(r.float8 for regions in all_regions for r in regions)
    total = sum(len(regions) for regions in all_regions)
    logger.info("applied TP %d%s%s to %d blocks (%d of %d communication regions in float8)", tp_mesh.size(),
                " + sequence parallel" if sequence_parallel else "", " + loss parallel" if loss_parallel else "",
                len(all_regions), float8, total)
    return all_regions


def _block_styles(plan: BlockTPPlan, regions: list[TPRegion], residual: Placement,
                  sequence_parallel: bool) -> dict[str, ParallelStyle]:
    """The styles of one block under ``plan`` (already restricted to the block's modules)."""
    float8 = {region.name: region.float8 for region in regions}
    styles: dict[str, ParallelStyle] = {fqn: ReplicatedInRegion() for fqn in plan.replicated}
    for tp_input in plan.inputs:
        colwise, _, prepare_input = _styles(float8[tp_input.name])
        # Only the first positional input is the activation; the rest (e.g. the rotary table) pass through.
        passthrough = (None,) * (tp_input.n_inputs - 1)
        styles[tp_input.module] = prepare_input(input_layouts=(residual, *passthrough),
                                                desired_input_layouts=(Replicate(), *passthrough))
        for fqn in tp_input.consumers:
            if fqn not in plan.replicated:
                styles[fqn] = colwise()
    for fqn in plan.colwise_from_replicated:
        styles[fqn] = ColwiseInPartialRegion()
    for fqn in plan.rowwise:
        _, rowwise, _ = _styles(float8[f"{fqn} output"])
        styles[fqn] = rowwise(output_layouts=residual)
    if sequence_parallel:
        for norm in plan.norms:
            styles[norm] = SequenceParallel()
    for norm in plan.head_norms:
        # Input [batch, seq, local heads, head_dim]: each rank normalises its heads (dim 2) over head_dim.
        styles[norm] = SequenceParallel(sequence_dim=2, use_local_output=True)
    if plan.moe is not None:
        styles |= _moe_styles(plan.moe, residual)
    return styles


def _moe_styles(plan: MoETPPlan, residual: Placement) -> dict[str, ParallelStyle]:
    """Expert tensor parallelism of the block's MoE layer."""
    styles: dict[str, ParallelStyle] = {
        plan.module: GatheredRegion(residual),
        plan.router: ReplicatedRouter(),
        plan.experts: ExpertTensorParallel(),
    }
    for fqn in plan.shared_colwise:
        styles[fqn] = ColwiseInPartialRegion()
    for fqn in plan.shared_rowwise:
        styles[fqn] = RowwiseParallel(output_layouts=Partial())
    return styles


class _EmbeddingParallel(RowwiseParallel):
    """Vocabulary-sharded embedding whose output redistribution completes before the first block.

    RowwiseParallel hands on an AsyncCollectiveTensor (the reduce waits at first use). Fed to a compiled
    block, its gradient comes back as a plain tensor that the redistribution's backward cannot take, so
    the wait happens here; the block's first op would wait at once anyway.
    """

    @staticmethod
    def _prepare_output_fn(output_layouts: Any, use_local_output: bool, mod: nn.Module, outputs: Any,
                           device_mesh: DeviceMesh) -> Any:
        if outputs.placements != output_layouts:
            outputs = outputs.redistribute(placements=output_layouts, async_op=False)
        return outputs.to_local() if use_local_output else outputs


def _styles(float8: bool) -> tuple[type, type, type]:
    if float8:
        from torchao.float8.float8_tensor_parallel import (
            Float8ColwiseParallel,
            Float8RowwiseParallel,
            PrepareFloat8ModuleInput,
        )

        return Float8ColwiseParallel, Float8RowwiseParallel, PrepareFloat8ModuleInput
    return ColwiseParallel, RowwiseParallel, PrepareModuleInput


def loss_parallel_context(enabled: bool) -> contextlib.AbstractContextManager:
    """Context for computing the loss (and its backward) on vocab-sharded logits; a no-op when disabled."""
    return loss_parallel() if enabled else contextlib.nullcontext()


def local_loss(loss: torch.Tensor) -> torch.Tensor:
    """Plain tensor from the (replicated) DTensor loss that loss parallelism returns."""
    return loss.full_tensor() if hasattr(loss, "full_tensor") else loss
