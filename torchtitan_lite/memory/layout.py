"""Where every parameter of a run's model lives, per rank: built on the meta device, sharded on paper.

The shapes follow the family's ``ParallelPlan`` (models/<family>/parallelize.py), the same table the
trainer's parallelize step applies:

- TP: column-parallel Linears and the output projection split dim 0 (output features), row-parallel
  Linears dim 1 (input features), the embedding its vocabulary rows (dim 0); norms are replicated.
- FSDP2: the units of ``ParallelPlan.fsdp_units``: one per block, one for the embedding, one for final norm
  + output (the "head"), and the root; a tied embedding stays with the root. FSDP2 shards dim 0 of the
  (TP-local) tensor and pads it to a multiple of the shard degree: every rank stores ceil(dim0 / dp_shard) rows
  (`FSDPParam._init_sharded_param`, torch/distributed/fsdp/_fully_shard/_fsdp_param.py), so rank 0's
  shapes below are also the padded storage of every rank.
- dp_replicate copies the shards (HSDP): it does not divide anything. Context parallelism (cp) does: its ranks
  hold the same weights, so FSDP shards over dp_shard x cp (and the experts over dp_shard x cp / ep).
- EP (the family's MoE facts name the routed experts): each EP rank holds num_experts / ep whole experts
  (dim 0 of the stacked expert weights), and FSDP2 shards those over the dp_shard / ep ranks left after
  EP (ParallelDims.expert_fsdp_degree), dim 0 padded as above. All other parameters are sharded over
  dp_shard as without EP, so for every rank the expert bytes at rest are the same as FSDP over dp_shard
  when the degrees divide; what EP changes is what FSDP gathers and reduce-scatters (E / ep experts per
  MoE layer, not E) and the token all-to-all (memory/routed.py).
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from torchtitan_lite.components.quantization import linear_quantizer
from torchtitan_lite.distributed.tensor_parallel import TPRegion, tp_regions
from torchtitan_lite.mesh.parallel_dims import ParallelDims
from torchtitan_lite.protocols.model_shape import ModelShape
from torchtitan_lite.protocols.model_size import ParamCounts, param_counts
from torchtitan_lite.protocols.moe_facts import MoEFacts
from torchtitan_lite.resolved_run import ResolvedRun

MASTER_WEIGHT_BYTES = 4
"""Parameters are created and kept in float32 (precision.py: master weights always stay float32)."""

@dataclass(frozen=True)
class ParamLayout:
    fqn: str
    global_shape: tuple[int, ...]
    tp_shape: tuple[int, ...]
    """Shape after the model-parallel splits (TP; EP for routed experts): what one rank all-gathers from
    its FSDP shard group."""
    local_shape: tuple[int, ...]
    """Shape on rank 0 after TP and FSDP (with FSDP's padding, every rank's storage)."""
    unit: str
    """FSDP unit holding the parameter (ParallelPlan.fsdp_unit; routed experts count with their block)."""
    is_linear: bool
    casts_master_weight: bool
    """Its Linear is converted to one that casts the master weight itself (float8): autocast makes no
    low-precision copy of it."""
    gather_itemsize: float | None = None
    """Bytes per element FSDP all-gathers it in when not the parameter dtype's (float8 all-gather: 1; blockwise
    FP8: 1 + 4/16384 for the block scales)."""
    replicated_grad: bool = False
    """Backward produces this parameter's gradient unsharded on every TP rank (see model_layout)."""
    routed_expert: bool = False
    """A routed expert weight (the family's MoE facts): split over EP, then FSDP over the ranks left."""

    @property
    def global_numel(self) -> int:
        return math.prod(self.global_shape)

    @property
    def local_numel(self) -> int:
        return math.prod(self.local_shape)

    @property
    def tp_numel(self) -> int:
        return math.prod(self.tp_shape)


@dataclass(frozen=True)
class LinearLayout:
    fqn: str
    """Module name; a tied output projection is listed although its weight is tok_embeddings.weight."""
    unit: str
    """FSDP unit holding its weight (as ParamLayout.unit)."""
    in_features: int
    out_features: int
    tp_numel: int
    """Weight elements one rank computes with (after TP)."""
    converted: bool
    """Swapped for the run's low-precision (float8 / MX) Linear, which casts its operands to 1 byte."""
    casts_master_weight: bool
    """Converted, and it casts the master weight itself (float8); an MX Linear instead takes its operands in
    the compute dtype (an autocast-dtype copy of the weight without FSDP), as a plain Linear does."""


@dataclass(frozen=True)
class ModelLayout:
    args: ModelShape
    """The model family's args; the estimator reads their shape (dim, n_heads, kv_heads, head_dim,
    ffn_hidden_dim, vocab_size, n_layers)."""
    dims: ParallelDims
    params: tuple[ParamLayout, ...]
    linears: tuple[LinearLayout, ...]
    buffer_bytes: int
    """Non-persistent buffers (the float32 rotary table), replicated on every rank."""
    float8_all_gather: bool
    """FSDP all-gathers some converted Linears' weights in FP8 (the converter says so, FSDP is on)."""
    all_gather_text: str
    """Bytes per weight element FSDP all-gathers, per recipe and why; '' without FSDP."""
    tp_regions: tuple[TPRegion, ...]
    """Each block's TP communication regions and whether they move float8 (identical for every block
    unless a filter names single blocks; this is the first converted block's: keep_first_blocks_hp skips the
    ones before it). Empty without TP."""
    moe: MoEFacts | None = None
    """The family's MoE facts for these args (None: a dense model)."""
    counts: ParamCounts | None = None
    """Total and active parameters of the model."""
    block_keys: tuple[str, ...] = ()
    """The keys of the model's blocks (in model.<blocks>), in order."""
    tied: bool = False
    """The embedding and the output projection share one matrix."""

    @property
    def float8_tp_regions(self) -> frozenset[str]:
        return frozenset(r.name for r in self.tp_regions if r.float8)

    def unit_params(self, unit: str) -> list[ParamLayout]:
        return [p for p in self.params if p.unit == unit]

    def restricted(self, units: set[str], *, modules: int) -> ModelLayout:
        """The part of the layout in FSDP ``units`` (a pipeline rank's stages), held by ``modules`` stage
        modules: each keeps its own copy of the buffers (the rotary table)."""
        return dataclasses.replace(self, params=tuple(p for p in self.params if p.unit in units),
                                   linears=tuple(lin for lin in self.linears if lin.unit in units),
                                   buffer_bytes=self.buffer_bytes * modules)


def model_layout(run: ResolvedRun) -> ModelLayout:
    """Shard the run's model (built on meta) over its ranks as the trainer would."""
    dims, args, plan = run.parallel_dims, run.model_args, run.model_spec.parallel_plan
    facts = run.moe_facts
    with torch.device("meta"):
        model = run.model_spec.model_cls(args)

    # What the run's low-precision Linear converter (if any) does is the converter's to say; a TP split that
    # some converter cannot run is refused here with every converter's modules at once, as the build would.
    run.converters.check_tp_shards(model)
    quantizer = linear_quantizer(run.converters.converters)
    converted: set[str] = set()
    if quantizer is not None:
        converted = {row.fqn for row in quantizer.plan_rows(model) if row.recipe is not None}
    from_master = converted if quantizer is not None and quantizer.casts_master_weight else set()
    gather: dict[str, tuple[float | None, str]] = {}
    if quantizer is not None and dims.fsdp_enabled:
        gather = quantizer.all_gather_per_linear(quantizer.plan_rows(model))
    tied = model.get_submodule(plan.output).weight is model.get_submodule(plan.embedding).weight
    # Context-parallel ranks hold the same weights and join the FSDP group: it shards over dp_shard x cp.
    shard = dims.dp_shard * dims.cp if dims.fsdp_enabled else 1
    expert_shard = dims.expert_fsdp_degree if dims.fsdp_enabled else 1  # dp_shard x cp / ep under CP

    linear_modules = {fqn: m for fqn, m in model.named_modules() if isinstance(m, nn.Linear)}
    params = []
    for fqn, p in model.named_parameters():  # a tied matrix is listed once, as the embedding's weight
        module = fqn.rsplit(".", 1)[0]
        routed = facts is not None and facts.is_routed_expert(fqn, plan.blocks)
        global_shape = _ep_shape(tuple(p.shape), dims.ep) if routed else tuple(p.shape)
        tp_shape = _tp_shape(plan.param_tp_shard_dim(fqn), global_shape, dims.tp)
        params.append(ParamLayout(
            fqn=fqn, global_shape=tuple(p.shape), tp_shape=tp_shape,
            local_shape=_fsdp_shape(tp_shape, expert_shard if routed else shard), routed_expert=routed,
            unit=plan.fsdp_unit(module, tied=tied), is_linear=module in linear_modules,
            casts_master_weight=module in from_master, gather_itemsize=gather.get(module, (None, ""))[0],
            # DTensor's embedding backward has no row-sharded strategy (embedding_dense_backward_strategy in
            # torch/distributed/tensor/_ops/_embedding_ops.py), so the vocabulary-sharded embedding gets a
            # replicated, full-size gradient on every TP rank.
            replicated_grad=dims.tp_enabled and module == plan.embedding,
        ))
    linears = tuple(
        LinearLayout(fqn=fqn, unit=plan.fsdp_unit(fqn, tied=tied), in_features=m.in_features, out_features=m.out_features,
                     tp_numel=math.prod(_tp_shape(plan.tp_shard_dim(fqn), tuple(m.weight.shape), dims.tp)),
                     converted=fqn in converted, casts_master_weight=fqn in from_master)
        for fqn, m in linear_modules.items()
    )
    buffer_bytes = sum(b.numel() * b.element_size() for b in model.buffers())

    float8_comms = quantizer is not None and quantizer.float8_tp_communication
    first_block = f"{plan.blocks}.{quantizer.plan_config.keep_first_blocks_hp if quantizer is not None else 0}"
    regions = tuple(tp_regions(plan.block_tp, lambda fqn: float8_comms and f"{first_block}.{fqn}" in converted)
                    ) if dims.tp_enabled else ()
    return ModelLayout(
        args=args, dims=dims, params=tuple(params), linears=linears, buffer_bytes=buffer_bytes,
        float8_all_gather=any(size is not None for size, _ in gather.values()), tp_regions=regions, moe=facts,
        counts=param_counts(model, facts, blocks=plan.blocks, embedding=plan.embedding),
        block_keys=tuple(getattr(model, plan.blocks).keys()), tied=tied,
        all_gather_text=_all_gather_text(run, quantizer, gather) if dims.fsdp_enabled else "",
    )


def _ep_shape(shape: tuple[int, ...], ep: int) -> tuple[int, ...]:
    # resolve_run checked that ep divides the experts: whole experts per EP rank.
    return (shape[0] // ep,) + shape[1:]


def _all_gather_text(run: ResolvedRun, quantizer: Any, gather: dict[str, tuple[float | None, str]]) -> str:
    """'FSDP all-gather per weight element: <n> <recipe> Linears <bytes> (why); ...; other parameters <bytes>'."""
    dtype = run.precision.param_dtype
    dtype_bytes, dtype_name = dtype.itemsize, str(dtype).removeprefix("torch.")
    groups: dict[tuple[float, str], int] = {}
    for size, why in gather.values():
        key = (size, why) if size is not None else (float(dtype_bytes), f"{dtype_name}: {why}")
        groups[key] = groups.get(key, 0) + 1
    recipe = quantizer.plan_config.recipe_name if quantizer is not None else ""
    parts = [f"{n} {recipe} Linears {size:.6g} ({why})" for (size, why), n in groups.items()]
    parts.append(f"{'other parameters' if parts else 'every parameter'} {dtype_bytes} ({dtype_name})")
    return "FSDP all-gather bytes per weight element: " + "; ".join(parts)


def _tp_shape(dim: int | None, shape: tuple[int, ...], tp: int) -> tuple[int, ...]:
    if tp == 1 or dim is None:
        return shape
    # DTensor's Shard gives rank 0 the ceil-sized chunk.
    return tuple(math.ceil(s / tp) if d == dim else s for d, s in enumerate(shape))


def _fsdp_shape(shape: tuple[int, ...], shard: int) -> tuple[int, ...]:
    if shard == 1:
        return shape
    return (math.ceil(shape[0] / shard),) + shape[1:]
