"""Sizes both estimators share (the rank of one training step, step_rank.py, and a pipeline rank,
pipeline_rank.py): the activation setup of a micro-batch, the per-unit bytes of gathered parameters,
gradients, autocast copies and float8 casts, and the MoE share of the terms."""
from __future__ import annotations

import math

from torchtitan_lite.memory.activations import ActivationSetup, block_saved_bytes
from torchtitan_lite.memory.layout import MASTER_WEIGHT_BYTES, ModelLayout, ParamLayout
from torchtitan_lite.memory.optimizer_states import state_bytes, step_temporary_bytes
from torchtitan_lite.memory.routed import EP_RECEIVE_HEADROOM, RoutedSetup, all_to_all_bytes
from torchtitan_lite.memory.terms import MemoryTerm
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
        tokens=run.pipeline.microbatch_size * run.training.seq_len if run.pipeline else run.tokens_per_microbatch,
        dim=args.dim, n_heads=args.n_heads, n_kv_heads=args.n_kv_heads, head_dim=args.head_dim,
        # A family whose every block is an MoE layer has no dense feed-forward width.
        ffn_dim=getattr(args, "ffn_hidden_dim", 0), moe=moe,
        vocab_size=args.vocab_size, n_layers=args.n_layers, tp=dims.tp,
        sequence_parallel=run.parallelism.enable_sequence_parallel, loss_parallel=run.parallelism.enable_loss_parallel,
        # Without FSDP, low precision comes from autocast: parameters, embedding output and residual stay fp32.
        compute_bytes=param_bytes, residual_bytes=4 if precision.autocast else param_bytes,
        autocast=precision.autocast, float8_tp_regions=layout.float8_tp_regions,
        device_type=run.device_type, compiled_loss=run.compile_loss,
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
    scratch, how = step_temporary_bytes([p.local_numel for p in layout.params], low_bit=run.optimizer.low_bit,
                                        implementation=run.optimizer.implementation, device_type=run.device_type)
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
