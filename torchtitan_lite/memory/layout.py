"""Where every parameter of a run's model lives, per rank: built on the meta device, sharded on paper.

The shapes follow the family's ``ParallelPlan`` (models/<family>/parallelize.py), the same table the
trainer's parallelize step applies:

- TP: column-parallel Linears and the output projection split dim 0 (output features), row-parallel
  Linears dim 1 (input features), the embedding its vocabulary rows (dim 0); norms are replicated.
- FSDP2: one unit per block, one for the embedding, one for final norm + output (the "head"), and the
  root; a tied embedding stays with the root. FSDP2 shards dim 0 of the (TP-local) tensor and pads it to
  a multiple of the shard degree: every rank stores ceil(dim0 / dp_shard) rows
  (`FSDPParam._init_sharded_param`, torch/distributed/fsdp/_fully_shard/_fsdp_param.py), so rank 0's
  shapes below are also the padded storage of every rank.
- dp_replicate copies the shards (HSDP): it does not divide anything.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from torchtitan_lite.components.quantization import Float8LinearConverter, MXLinearConverter, linear_quantizer
from torchtitan_lite.components.quantization.float8_plan import float8_plan
from torchtitan_lite.distributed.parallel_dims import ParallelDims
from torchtitan_lite.distributed.tensor_parallel import TPRegion, tp_regions
from torchtitan_lite.protocols.model_spec import ParallelPlan
from torchtitan_lite.resolved_run import ResolvedRun

MASTER_WEIGHT_BYTES = 4
"""Parameters are created and kept in float32 (precision.py: master weights always stay float32)."""

@dataclass(frozen=True)
class ParamLayout:
    fqn: str
    global_shape: tuple[int, ...]
    tp_shape: tuple[int, ...]
    """Shape after TP only: what one rank all-gathers from its FSDP shard group."""
    local_shape: tuple[int, ...]
    """Shape on rank 0 after TP and FSDP (with FSDP's padding, every rank's storage)."""
    unit: str
    """FSDP unit holding the parameter: 'layers.<i>', 'tok_embeddings', 'head' (norm + output) or 'root'."""
    is_linear: bool
    float8: bool
    """The Linear is swapped for torchao's Float8Linear by the config's float8 converter."""
    replicated_grad: bool = False
    """Backward produces this parameter's gradient unsharded on every TP rank (see model_layout)."""

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
    in_features: int
    out_features: int
    tp_numel: int
    """Weight elements one rank computes with (after TP)."""
    float8: bool
    mx: bool = False
    """Swapped for an MXFP8 Linear by the mx converter. Unlike Float8Linear it takes its operands in the
    compute dtype (an autocast-dtype copy of the weight without FSDP), then casts them to 1-byte MX."""


@dataclass(frozen=True)
class ModelLayout:
    args: Any
    """The model family's args dataclass; the estimator reads its transformer fields (dim, n_heads,
    n_kv_heads, head_dim, ffn_hidden_dim, vocab_size, n_layers)."""
    dims: ParallelDims
    params: tuple[ParamLayout, ...]
    linears: tuple[LinearLayout, ...]
    buffer_bytes: int
    """Non-persistent buffers (the float32 rotary table), replicated on every rank."""
    float8_all_gather: bool
    """FSDP all-gathers the float8 Linears' weights in float8 (tensorwise, enabled, and FSDP on)."""
    tp_regions: tuple[TPRegion, ...]
    """Each block's TP communication regions and whether they move float8 (identical for every block
    unless a filter names single blocks; this is the first converted block's: keep_first_blocks_hp skips the
    ones before it). Empty without TP."""

    @property
    def float8_tp_regions(self) -> frozenset[str]:
        return frozenset(r.name for r in self.tp_regions if r.float8)

    def unit_params(self, unit: str) -> list[ParamLayout]:
        return [p for p in self.params if p.unit == unit]


def model_layout(run: ResolvedRun) -> ModelLayout:
    """Shard the run's model (built on meta) over its ranks as the trainer would."""
    dims, args, plan = run.parallel_dims, run.model_args, run.model_spec.parallel_plan
    with torch.device("meta"):
        model = run.model_spec.model_cls(args)

    quantizer_cfg = _quantizer_config(run)
    float8_cfg = quantizer_cfg if isinstance(quantizer_cfg, Float8LinearConverter.Config) else None
    planned: set[str] = set()
    if quantizer_cfg is not None:
        planned = {row.fqn for row in float8_plan(model, quantizer_cfg, output_module=plan.output)
                   if row.recipe is not None}
    converted, mx_converted = (planned, set()) if float8_cfg is not None else (set(), planned)
    tied = model.get_submodule(plan.output).weight is model.get_submodule(plan.embedding).weight
    shard = dims.dp_shard if dims.fsdp_enabled else 1

    linear_modules = {fqn: m for fqn, m in model.named_modules() if isinstance(m, nn.Linear)}
    params = []
    for fqn, p in model.named_parameters():  # a tied matrix is listed once, as the embedding's weight
        module = fqn.rsplit(".", 1)[0]
        tp_shape = _tp_shape(plan, module, tuple(p.shape), dims.tp)
        params.append(ParamLayout(
            fqn=fqn, global_shape=tuple(p.shape), tp_shape=tp_shape, local_shape=_fsdp_shape(tp_shape, shard),
            unit=plan.fsdp_unit(module, tied=tied), is_linear=module in linear_modules, float8=module in converted,
            # DTensor's embedding backward has no row-sharded strategy (embedding_dense_backward_strategy in
            # torch/distributed/tensor/_ops/_embedding_ops.py), so the vocabulary-sharded embedding gets a
            # replicated, full-size gradient on every TP rank.
            replicated_grad=dims.tp_enabled and module == plan.embedding,
        ))
    linears = tuple(
        LinearLayout(fqn=fqn, in_features=m.in_features, out_features=m.out_features,
                     tp_numel=math.prod(_tp_shape(plan, fqn, tuple(m.weight.shape), dims.tp)),
                     float8=fqn in converted, mx=fqn in mx_converted)
        for fqn, m in linear_modules.items()
    )
    buffer_bytes = sum(b.numel() * b.element_size() for b in model.buffers())

    tensorwise = float8_cfg is not None and float8_cfg.recipe_name == "tensorwise"
    first_block = f"{plan.blocks}.{float8_cfg.keep_first_blocks_hp if float8_cfg is not None else 0}"
    regions = tuple(tp_regions(plan.block_tp, lambda fqn: tensorwise and f"{first_block}.{fqn}" in converted)
                    ) if dims.tp_enabled else ()
    return ModelLayout(
        args=args, dims=dims, params=tuple(params), linears=linears, buffer_bytes=buffer_bytes,
        float8_all_gather=bool(float8_cfg and float8_cfg.enable_fsdp_float8_all_gather and dims.fsdp_enabled),
        tp_regions=regions,
    )


def _quantizer_config(run: ResolvedRun) -> Float8LinearConverter.Config | MXLinearConverter.Config | None:
    quantizer = linear_quantizer(run.converters.converters)
    return None if quantizer is None else quantizer.config


def _tp_shape(plan: ParallelPlan, module: str, shape: tuple[int, ...], tp: int) -> tuple[int, ...]:
    dim = plan.tp_shard_dim(module)
    if tp == 1 or dim is None:
        return shape
    # DTensor's Shard gives rank 0 the ceil-sized chunk.
    return tuple(math.ceil(s / tp) if d == dim else s for d, s in enumerate(shape))


def _fsdp_shape(shape: tuple[int, ...], shard: int) -> tuple[int, ...]:
    if shard == 1:
        return shape
    return (math.ceil(shape[0] / shard),) + shape[1:]
