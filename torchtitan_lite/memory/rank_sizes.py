"""What every rank's estimate is built on, with or without a pipeline (the step of step_rank.py, a pipeline
rank's of pipeline_rank.py): the activation setup of a micro-batch, the rank's part of the model sized per
FSDP unit (RankSizes: gathered parameters, gradients, reduce-scatter buffers, autocast copies, float8 casts,
optimizer scratch), and the MoE share of the terms."""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from torchtitan_lite.distributed.pipeline.layout import StageLayout
from torchtitan_lite.memory.activations import ActivationSetup, block_saved_bytes
from torchtitan_lite.memory.layout import MASTER_WEIGHT_BYTES, ModelLayout, ParamLayout
from torchtitan_lite.memory.optimizer_states import state_bytes, step_temporary_bytes
from torchtitan_lite.memory.routed import EP_RECEIVE_HEADROOM, RoutedSetup, all_to_all_bytes
from torchtitan_lite.memory.terms import MemoryTerm
from torchtitan_lite.protocols.model_spec import FSDPUnit
from torchtitan_lite.resolved_run import ResolvedRun

# --------------------------------------------------------------------------------------------------
# Dtypes and setup


def activation_setup(run: ResolvedRun, layout: ModelLayout) -> ActivationSetup:
    args, dims, precision, facts = layout.args, layout.dims, run.precision, layout.moe
    param_bytes = precision.param_bytes
    blockwise = [c for c in run.converters.converters
                 if c.config.low_precision_experts and getattr(c.config, "recipe_name", "") == "blockwise"]
    moe = None if facts is None else RoutedSetup(
        num_experts=facts.num_experts, top_k=facts.top_k, hidden=facts.expert_hidden_dim,
        shared_hidden=facts.shared_hidden_dim, layers=frozenset(facts.layers), ep=dims.ep,
        float8_experts=any(c.config.low_precision_experts for c in run.converters.converters),
        blockwise_experts=bool(blockwise),
        float32_expert_gemms=any(not getattr(c.config, "power_of_2_scales", False) for c in blockwise))
    return ActivationSetup(
        # Under a pipeline, activations are those of one pipeline micro-batch.
        tokens=run.tokens_per_forward,
        dim=args.dim, n_heads=args.n_heads, n_kv_heads=args.kv_heads, head_dim=args.head_dim,
        # A family whose every block is an MoE layer has no dense feed-forward width.
        ffn_dim=args.ffn_hidden_dim, moe=moe,
        vocab_size=args.vocab_size, n_layers=args.n_layers, tp=dims.tp,
        sequence_parallel=run.sequence_parallel, loss_parallel=run.loss_parallel,
        # Without FSDP, low precision comes from autocast: parameters, embedding output and residual stay fp32.
        compute_bytes=param_bytes, residual_bytes=4 if precision.autocast else param_bytes,
        autocast=precision.autocast, float8_tp_regions=layout.float8_tp_regions,
        device_type=run.device_type, compiled_loss=run.compile_loss,
    )


# --------------------------------------------------------------------------------------------------
# A rank's part of the model


@dataclass(frozen=True)
class RankSizes:
    """What one rank holds of the model, whatever its step looks like: the part of the layout in its FSDP units
    (ParallelPlan.fsdp_units of its stages; without a pipeline, one stage holding the whole model), sized as a
    whole and per unit (keys: the units holding parameters, sorted)."""

    layout: ModelLayout
    units: tuple[FSDPUnit, ...]
    """The rank's FSDP units, in the plan's order."""
    fsdp: bool
    offload: bool
    """FSDP offloads parameters, gradients and optimizer states to the host."""
    params: int
    """fp32 master weights (on the host with CPU offload, as the states and gradients)."""
    states: int
    grads: dict[str, int]
    """fp32 gradients per unit."""
    scratch: int
    scratch_how: str
    unsharded: dict[str, int]
    """Gradients as backward produces them (unsharded_grad_bytes) per unit."""
    gathered: dict[str, int]
    """All-gathered parameter bytes per unit (empty without FSDP)."""
    reduce_buffers: dict[str, int]
    """FSDP's reduce_dtype copy of each unit's gradients for the reduce-scatter (0 without FSDP)."""
    reduce_bytes: int
    """Bytes per element of reduce_dtype."""
    autocast_copies: int
    float8: int

    @property
    def persistent(self) -> int:
        """Parameters, optimizer states and buffers resident on the device."""
        return (0 if self.offload else self.params + self.states) + self.layout.buffer_bytes

    def units_of(self, *kinds: str) -> tuple[str, ...]:
        """The names of the rank's units of ``kinds``, in the plan's order."""
        return tuple(u.name for u in self.units if u.kind in kinds)


def rank_sizes(run: ResolvedRun, full: ModelLayout, s: ActivationSetup, stages: Sequence[StageLayout]) -> RankSizes:
    """The sizes of the rank holding ``stages``: ``full`` restricted to their units (their blocks, the embedding
    on the first stage and the final norm + output head on the last), each stage module with its own buffers."""
    units = run.model_spec.parallel_plan.fsdp_units([b for st in stages for b in st.blocks], tied=full.tied,
                                                    first=any(st.first for st in stages),
                                                    last=any(st.last for st in stages))
    layout = full.restricted({u.name for u in units}, modules=len(stages))
    fsdp, param_bytes, low_bit = layout.dims.fsdp_enabled, run.precision.param_bytes, run.optimizer_low_bit
    reduce_bytes = torch.tensor([], dtype=run.precision.reduce_dtype).element_size()
    names = sorted({p.unit for p in layout.params})
    scratch, scratch_how = optimizer_scratch(run, layout)
    return RankSizes(
        layout=layout, units=units, fsdp=fsdp, offload=run.fsdp_cpu_offload and fsdp,
        params=sum(p.local_numel for p in layout.params) * MASTER_WEIGHT_BYTES,
        states=sum(state_bytes(p.local_numel, low_bit) for p in layout.params),
        grads={u: sum(grad_numel(p, fsdp) for p in layout.unit_params(u)) * MASTER_WEIGHT_BYTES for u in names},
        scratch=scratch, scratch_how=scratch_how,
        unsharded={u: unsharded_grad_bytes(layout, u, s, fsdp, param_bytes) for u in names},
        gathered={u: gathered_bytes(layout, u, param_bytes) for u in names} if fsdp else {},
        reduce_buffers={u: sum(p.tp_numel for p in layout.unit_params(u)) * reduce_bytes if fsdp else 0
                        for u in names},
        reduce_bytes=reduce_bytes, autocast_copies=autocast_copies(layout, s), float8=float8_cast_bytes(layout, s),
    )


# --------------------------------------------------------------------------------------------------
# Per-unit sizes


def gathered_bytes(layout: ModelLayout, unit: str, param_bytes: int) -> int:
    return sum(math.ceil(p.tp_numel * (p.gather_itemsize or param_bytes))
               for p in layout.unit_params(unit))


def grad_numel(p: ParamLayout, fsdp: bool) -> int:
    # FSDP turns a replicated gradient back into its shard before the reduce-scatter; without FSDP it is
    # stored as the replicated .grad.
    return p.global_numel if p.replicated_grad and not fsdp else p.local_numel


def unsharded_grad_bytes(layout: ModelLayout, unit: str, s: ActivationSetup, fsdp: bool, param_bytes: int) -> int:
    params = layout.unit_params(unit)
    if fsdp:
        # FSDP2's unsharded gradients in param_dtype; foreach_reduce then copies them into a fresh
        # reduce_dtype buffer for the reduce-scatter (`foreach_reduce_scatter_copy_in`, _fsdp_collectives.py).
        return sum(p.global_numel if p.replicated_grad else p.tp_numel for p in params) * param_bytes
    if s.autocast:
        # The gradient of autocast's low-precision weight copy, before it is cast into the fp32 .grad.
        return sum(p.tp_numel for p in params if p.is_linear and not p.casts_master_weight) * param_bytes
    return 0


def optimizer_scratch(run: ResolvedRun, layout: ModelLayout) -> tuple[int, str]:
    """The optimizer step's temporaries on the rank holding ``layout``, and how they are sized."""
    scratch, how = step_temporary_bytes([p.local_numel for p in layout.params], low_bit=run.optimizer_low_bit,
                                        implementation=run.optimizer_implementation, device_type=run.device_type)
    if not layout.dims.fsdp_enabled and any(p.replicated_grad for p in layout.params):
        # The optimizer's DTensor op redistributes a replicated gradient to the parameter's shard: a copy.
        scratch += sum(p.local_numel for p in layout.params if p.replicated_grad) * MASTER_WEIGHT_BYTES
        how += " + shard copy of the replicated embedding gradient"
    return scratch, how


def autocast_copies(layout: ModelLayout, s: ActivationSetup) -> int:
    if not s.autocast:
        return 0
    return sum(lin.tp_numel for lin in layout.linears if not lin.casts_master_weight) * s.compute_bytes


def float8_cast_bytes(layout: ModelLayout, s: ActivationSetup) -> int:
    converted = [lin for lin in layout.linears if lin.converted]
    # One Linear at a time: its float8 input (T x in), output gradient (T x out) and weight, 1 byte each
    # (MX adds one e8m0 scale byte per 32 elements, under 4%). Not modelled: the CPU torch._scaled_mm
    # upcasts its operands to float32 internally, and emulated MX dequantizes them to the compute dtype.
    return max((s.tokens * (lin.in_features + lin.out_features) + lin.tp_numel for lin in converted), default=0)


# --------------------------------------------------------------------------------------------------
# The MoE share of the terms


def moe_terms(layout: ModelLayout, s: ActivationSetup, low_bit: str | None) -> list[MemoryTerm]:
    """The MoE share of the rows above (already counted in them), and the all-to-all buffers."""
    if s.moe is None:
        return []
    r = s.moe
    expert = [p for p in layout.params if p.routed_expert]
    expert_params = sum(p.local_numel for p in expert) * MASTER_WEIGHT_BYTES
    layer = min(r.layers)
    routed = {k: v for k, v in block_saved_bytes(s, layer).items()
              if k in ("router", "dispatch", "routed experts", "combine", "shared experts")}
    dims = layout.dims
    where = (f"{r.local_experts} of {r.num_experts} experts per EP rank, FSDP {dims.expert_fsdp_degree} over them"
             if dims.ep_enabled else f"{r.num_experts} experts, sharded with the other parameters")
    a2a = all_to_all_bytes(r, tokens=s.tokens, dim=s.dim, compute_bytes=s.compute_bytes)
    return [
        MemoryTerm("  expert parameters", expert_params, f"of parameters above: {where}"),
        MemoryTerm("  expert grads + states", expert_params + sum(state_bytes(p.local_numel, low_bit) for p in expert),
                   "of gradients and optimizer states above"),
        MemoryTerm("  routed activations", sum(routed.values()),
                   f"of activations above, per MoE layer without AC: {r.sent_rows(s.tokens)} routed rows (tokens x "
                   f"top_k {r.top_k}) sent, {r.received_rows(s.tokens)} received"
                   + (f" (x{EP_RECEIVE_HEADROOM} assumed imbalance)" if dims.ep_enabled else "")),
        MemoryTerm("all-to-all buffers", a2a,
                   f"send + receive of one exchange, in the block backward transient: ({r.sent_rows(s.tokens)} + "
                   f"{r.received_rows(s.tokens)}) rows x dim {s.dim}" if a2a else "no EP: tokens stay on their rank"),
    ]
