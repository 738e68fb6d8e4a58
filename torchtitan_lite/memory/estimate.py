"""Per-rank memory of a training config, predicted before launch from the config alone.

`estimate_run_memory(run)` takes the resolved run (torchtitan_lite/resolved_run.py: degrees, model args,
precision with 'auto' decided, micro-batches, converters), builds the model on the meta device, lays its
parameters out by the family's parallel plan (TP, then FSDP2 sharding; memory/layout.py), sizes every
component below per rank, and finds the peak over the moments of a training step (memory/timeline.py).
`estimate_memory(config, world_size=N)` resolves the run first.

Components:

  parameters        float32 master weights, sharded by TP and by FSDP (dp_shard); dp_replicate copies them;
                    routed experts split over EP, then FSDP over dp_shard / ep (memory/layout.py)
  optimizer states  AdamW: 2 fp32 moments + a float32 `step` per parameter; torchao low-bit: codes + fp32
                    block scales (+ qmap) per moment, fp32 for small tensors (memory/optimizer_states.py)
  buffers           the float32 rotary table, on every rank
  gradients         float32 with the parameters' sharding: FSDP2 casts the reduce-scattered gradient back
                    to the sharded parameter's dtype (`reduce_output = _to_dtype_if_needed(reduce_output,
                    orig_dtype)` in `foreach_reduce`, torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py)
                    and without FSDP autograd accumulates into the float32 parameter's .grad (under TP
                    the embedding's gradient is replicated: see memory/layout.py)
  step scratch      temporaries of the optimizer kernel (none for the fused kernel that 'auto' picks)
  activations       what every block keeps for backward under the AC mode (memory/activations.py); MoE
                    blocks: router, routed rows, expert GEMMs and combine (memory/routed.py)
  all-to-all        under EP, the send + receive buffers of one token exchange (part of the block backward
                    transient; the busiest rank's receive side assumes EP_RECEIVE_HEADROOM)
  head activations  the final norm's and the output projection's saved inputs
  loss transient    cross-entropy in float32: saved log-probs + gradients in and out of log-softmax
  FSDP gathered     all-gathered parameters in param_dtype (1 byte for float8 all-gathered weights); the
                    row gives the largest amount gathered at once
  autocast copies   without FSDP and below float32: autocast's cached low-precision copy of each
                    high-precision Linear weight; the cache is freed when the autocast region exits, and
                    the trainer runs backward inside it, so they last until the optimizer step
  float8 casts      float8 input, weight and output-gradient copies of one converted Linear; torchao 0.18
                    saves the high-precision input and weight and re-casts in backward
                    (`ctx.save_for_backward(input_hp, weight_hp_t)` in torchao/float8/float8_linear.py;
                    `force_recompute_fp8_weight_in_bwd` is deprecated there and changes nothing)
  CUDA context      on CUDA only, `CUDA_CONTEXT_BYTES` that the caching allocator never sees

Under pipeline parallelism every pipeline rank is sized on its own (``estimate_pipeline_ranks``): the
parameters, gradients and optimizer states of its stages, the activations of the micro-batches it holds at
once (replayed from torch's schedule, distributed/pipeline/in_flight.py), FSDP's gathered weights and
accumulated unsharded gradients, the receive buffers (memory/pipeline_timeline.py); ``estimate_run_memory``
returns the largest rank's.

`peak_allocated` is comparable with `torch.cuda.max_memory_allocated()`, `total` with nvidia-smi. The
activation terms describe eager execution (checked against autograd's saved tensors and the CPU
profiler in tests/unit/test_memory_estimate.py); torch.compile usually saves less, so compiled runs
should come in under the estimate. The vocabulary is the flavor's, grown to the tokenizer's as the
trainer does. The device type matters (the RMSNorm kernel differs): it defaults to this machine's, the
one a training command launched here would use.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from torchtitan_lite.distributed import utils as dist_utils
from torchtitan_lite.distributed.pipeline.in_flight import max_in_flight, peak_held_bytes
from torchtitan_lite.distributed.pipeline.layout import StageLayout
from torchtitan_lite.memory.activations import (
    ActivationSetup,
    block_backward_working_bytes,
    block_plan,
    block_saved_bytes,
    head_saved_bytes,
    logits_grad_bytes,
    loss_transient_bytes,
)
from torchtitan_lite.memory.layout import MASTER_WEIGHT_BYTES, ModelLayout, ParamLayout, model_layout
from torchtitan_lite.memory.optimizer_states import state_bytes, step_temporary_bytes
from torchtitan_lite.memory.pipeline_timeline import PipelineRankSizes, pipeline_moments
from torchtitan_lite.memory.routed import EP_RECEIVE_HEADROOM, RoutedSetup, all_to_all_bytes
from torchtitan_lite.memory.timeline import Moment, StepSizes, step_moments
from torchtitan_lite.resolved_run import ResolvedRun, resolve_run

if TYPE_CHECKING:
    from torchtitan_lite.trainer import Trainer

GIB = 1024**3

CUDA_CONTEXT_BYTES = 768 * 1024**2
"""CUDA context, loaded kernels, cuBLAS/NCCL internal buffers: device memory that nvidia-smi shows but
torch.cuda.max_memory_allocated() does not (typically 0.5-1 GiB on H100 with torch 2.x + NCCL)."""

@dataclass(frozen=True)
class MemoryTerm:
    name: str
    nbytes: int
    how: str


@dataclass(frozen=True)
class MemoryEstimate:
    terms: tuple[MemoryTerm, ...]
    """Size of each component (its largest value during the step for transient ones)."""
    moments: tuple[Moment, ...]
    """Device bytes allocated at each candidate peak moment of a step (memory/timeline.py)."""
    layout: str
    device_type: str
    world_size: int
    model: str = ""
    """Total and active parameters of the model."""
    all_gather: str = ""
    """Bytes per weight element FSDP all-gathers, per recipe and why ('' without FSDP)."""
    pp_rank: int | None = None
    """Under pipeline parallelism: the pipeline rank this estimate is of (None without a pipeline)."""
    stages: str = ""
    """Under pipeline parallelism: the rank's stages and the micro-batches each holds at most."""

    def __getitem__(self, name: str) -> int:
        for term in self.terms:
            if term.name == name:
                return term.nbytes
        raise KeyError(f"no memory term {name!r}; terms: {[t.name for t in self.terms]}")

    @property
    def parameters(self) -> int:
        return self["parameters"]

    @property
    def gradients(self) -> int:
        return self["gradients"]

    @property
    def optimizer_states(self) -> int:
        return self["optimizer states"]

    def moment(self, name: str) -> Moment:
        for moment in self.moments:
            if moment.name == name:
                return moment
        raise KeyError(f"no moment {name!r}; moments: {[m.name for m in self.moments]}")

    @property
    def peak_moment(self) -> Moment:
        return max(self.moments, key=lambda m: m.nbytes)

    @property
    def peak_allocated(self) -> int:
        """Peak bytes held by the framework's allocator (torch.cuda.max_memory_allocated on CUDA)."""
        return self.peak_moment.nbytes

    @property
    def total(self) -> int:
        """Peak device memory including the CUDA context the allocator does not see."""
        return self.peak_allocated + (CUDA_CONTEXT_BYTES if self.device_type == "cuda" else 0)


def estimate_memory(config: Trainer.Config, *, world_size: int, device_type: str | None = None) -> MemoryEstimate:
    """Predict the per-rank memory of training `config` on `world_size` ranks of `device_type`
    ('cuda' or 'cpu'; default: this machine's)."""
    device_type = device_type or dist_utils.device_type()
    return estimate_run_memory(resolve_run(config, world_size=world_size, device_type=device_type))


def estimate_run_memory(run: ResolvedRun) -> MemoryEstimate:
    """Predict the per-rank memory of the resolved run; under pipeline parallelism, of its largest pipeline
    rank (``estimate_pipeline_ranks`` gives every rank)."""
    if run.pipeline is not None:
        return max(estimate_pipeline_ranks(run), key=lambda e: e.peak_allocated)
    device_type, world_size = run.device_type, run.world_size
    layout = model_layout(run)
    dims, ac = layout.dims, run.activation_checkpoint
    param_bytes = run.precision.param_bytes
    reduce_bytes = torch.tensor([], dtype=run.precision.reduce_dtype).element_size()
    s = _activation_setup(run, layout)
    optimizer = run.optimizer
    fsdp = dims.fsdp_enabled
    offload = run.parallelism.fsdp_cpu_offload and fsdp
    units = sorted({p.unit for p in layout.params})
    low_bit = optimizer.low_bit

    params = sum(p.local_numel for p in layout.params) * MASTER_WEIGHT_BYTES
    states = sum(state_bytes(p.local_numel, low_bit) for p in layout.params)
    grads = {u: sum(_grad_numel(p, fsdp) for p in layout.unit_params(u)) * MASTER_WEIGHT_BYTES for u in units}
    scratch, scratch_how = step_temporary_bytes([p.local_numel for p in layout.params], low_bit=low_bit,
                                                implementation=optimizer.implementation,
                                                device_type=device_type)
    if not fsdp and any(p.replicated_grad for p in layout.params):
        # The optimizer's DTensor op redistributes a replicated gradient to the parameter's shard: a copy.
        scratch += sum(p.local_numel for p in layout.params if p.replicated_grad) * MASTER_WEIGHT_BYTES
        scratch_how += " + shard copy of the replicated embedding gradient"
    plan = block_plan(s, ac.mode, ac.selective_option)
    gathered = {u: _gathered_bytes(layout, u, param_bytes) for u in units} if fsdp else {}
    float8 = _float8_cast_bytes(layout, s)
    sizes = StepSizes(
        persistent=(0 if offload else params + states) + layout.buffer_bytes,
        grads={u: 0 if offload else g for u, g in grads.items()},
        unsharded_grads={u: _unsharded_grad_bytes(layout, u, s, fsdp, param_bytes) for u in units},
        reduce_buffers={u: sum(p.tp_numel for p in layout.unit_params(u)) * reduce_bytes if fsdp else 0
                        for u in units},
        gathered=gathered, block_plan=plan, head_saved=head_saved_bytes(s), autocast_copies=_autocast_copies(layout, s),
        loss_transient=loss_transient_bytes(s), logits_grad=logits_grad_bytes(s),
        block_working=block_backward_working_bytes(s) + float8, optimizer_scratch=0 if offload else scratch,
        accumulating=run.n_microbatches > 1,
        reshard_after_forward=run.parallelism.fsdp_reshard_after_forward,
        head_units=tuple(u for u in ("head", "root") if u in units),
    )
    moments = step_moments(sizes)

    sharding = _sharding_text(layout)
    where = " (host: CPU offload)" if offload else ""
    mode = ac.mode if ac.mode != "selective" else f"selective {ac.selective_option}"
    kept = [k for k, _ in plan]
    terms = [
        MemoryTerm("parameters", params, f"fp32 master weights, {sharding}{where}"),
        MemoryTerm("optimizer states", states, _optimizer_text(low_bit) + where),
        MemoryTerm("buffers", layout.buffer_bytes, "fp32 rotary table, replicated"),
        MemoryTerm("gradients", sum(grads.values()), f"fp32, {sharding}{where}"),
        MemoryTerm("optimizer step scratch", sizes.optimizer_scratch, scratch_how),
        MemoryTerm("activations", sum(kept),
                   f"AC {mode}: {len(kept)} blocks x {_mib(max(kept))} max, {s.tokens} tokens/micro-batch, "
                   f"{param_bytes}-byte compute"),
        MemoryTerm("head activations", sizes.head_saved, "final norm + output projection input"),
        MemoryTerm("loss transient", sizes.loss_transient,
                   "compiled: logits + their gradient" if s.compiled_loss else "fp32 log-probs + 2 fp32 gradients"),
        MemoryTerm("block backward transient", max(r for _, r in plan) + sizes.block_working,
                   "recomputed activations (AC) + activation gradients of one block"),
        *_moe_terms(layout, s, low_bit),
        MemoryTerm("FSDP gathered params", max(m.parts.get("FSDP gathered", 0) for m in moments),
                   _gathered_text(run, fsdp, layout)),
        MemoryTerm("autocast weight copies", sizes.autocast_copies,
                   f"{param_bytes}-byte copy of each non-float8 Linear weight" if s.autocast else "no autocast"),
        MemoryTerm("float8 casts", float8, "float8 operands of the largest converted Linear" if float8
                   else "no float8 Linears"),
    ]
    if device_type == "cuda":
        terms.append(MemoryTerm("CUDA context", CUDA_CONTEXT_BYTES, "outside the caching allocator (constant)"))
    return MemoryEstimate(terms=tuple(terms), moments=tuple(moments),
                          layout=f"{dims.describe()} (world size {world_size})", device_type=device_type,
                          world_size=world_size, model=layout.counts.describe() if layout.counts else "",
                          all_gather=layout.all_gather_text)


def estimate_pipeline_ranks(run: ResolvedRun) -> list[MemoryEstimate]:
    """The memory of every pipeline rank (index = pp_rank) of a run with pipeline parallelism. A rank holds
    its stages' blocks, the embedding on the first stage and the final norm + output head on the last, each
    sharded by TP / FSDP / EP as without a pipeline; one micro-batch is pipeline_microbatch_size samples."""
    layout = model_layout(run)
    s = _activation_setup(run, layout)
    return [_pipeline_rank_estimate(run, layout, s, rank) for rank in range(run.parallel_dims.pp)]


def _pipeline_rank_estimate(run: ResolvedRun, full: ModelLayout, s: ActivationSetup, pp_rank: int) -> MemoryEstimate:
    pipe, plan, ac = run.pipeline, run.model_spec.parallel_plan, run.activation_checkpoint
    assert pipe is not None
    stage_ids = pipe.stage_ids(pp_rank)
    stages = [pipe.stages[i] for i in stage_ids]
    units = {f"{plan.blocks}.{b}" for st in stages for b in st.blocks}
    units |= {plan.embedding} if any(st.first for st in stages) else set()
    units |= {"head"} if any(st.last for st in stages) else set()
    layout = full.restricted(units, modules=len(stages))
    dims, precision, optimizer = layout.dims, run.precision, run.optimizer
    fsdp, low_bit = dims.fsdp_enabled, optimizer.low_bit
    param_bytes = precision.param_bytes
    reduce_bytes = torch.tensor([], dtype=precision.reduce_dtype).element_size()
    unit_names = sorted({p.unit for p in layout.params})

    params = sum(p.local_numel for p in layout.params) * MASTER_WEIGHT_BYTES
    states = sum(state_bytes(p.local_numel, low_bit) for p in layout.params)
    grads = sum(_grad_numel(p, fsdp) for p in layout.params) * MASTER_WEIGHT_BYTES
    scratch, scratch_how = step_temporary_bytes([p.local_numel for p in layout.params], low_bit=low_bit,
                                                implementation=optimizer.implementation, device_type=run.device_type)
    # Per stage: what one micro-batch keeps until its backward (AC counted from the stage's first block), and
    # on the last stage the logits the schedule keeps as the stage output with the loss's saved log-probs.
    plans = {sid: block_plan(s, ac.mode, ac.selective_option, [int(b) for b in pipe.stages[sid].blocks])
             for sid in stage_ids}
    tail = {sid: _held_loss_bytes(s) + head_saved_bytes(s) if pipe.stages[sid].last else _boundary_bytes(s)
            for sid in stage_ids}
    kept = {sid: sum(k for k, _ in plans[sid]) + tail[sid] for sid in stage_ids}
    held = peak_held_bytes(pipe, pp_rank, kept, {sid: _awaiting_weight_bytes(s, pipe.stages[sid]) for sid in stage_ids})
    per_stage, most = max_in_flight(pipe, pp_rank)
    unsharded = {u: _unsharded_grad_bytes(layout, u, s, fsdp, param_bytes) for u in unit_names}
    float8 = _float8_cast_bytes(layout, s)
    block_transient = max(r for sid in stage_ids for _, r in plans[sid]) + block_backward_working_bytes(s) + float8
    # What the loss saved is already held (_held_loss_bytes): the log-probs, or a compiled loss's logits.
    saved_by_loss = s.tokens * s.vocab * (s.compute_bytes if s.compiled_loss else 4)
    loss = loss_transient_bytes(s) - saved_by_loss if any(st.last for st in stages) else 0
    gathered = sum(_gathered_bytes(layout, u, param_bytes) for u in unit_names) if fsdp else 0
    if fsdp and run.fsdp_reshard_after_forward != "never":
        # Resharded units are gathered again for every micro-batch: two at once (computing + prefetched).
        gathered = sum(sorted((_gathered_bytes(layout, u, param_bytes) for u in unit_names), reverse=True)[:2])
    accumulated = sum(p.global_numel if p.replicated_grad else p.tp_numel for p in layout.params) * reduce_bytes
    recv = sum((0 if st.first else 1) + (0 if st.last else 1) for st in stages) * pipe.n_microbatches * _boundary_bytes(s)
    offload = run.parallelism.fsdp_cpu_offload and fsdp
    sizes = PipelineRankSizes(
        persistent=(0 if offload else params + states) + layout.buffer_bytes,
        autocast_copies=_autocast_copies(layout, s), grads=0 if offload else grads,
        fsdp=fsdp, accumulating=run.n_microbatches > 1, gathered=gathered,
        accumulated_grads=accumulated if fsdp else 0,
        reduce_buffer=max((sum(p.tp_numel for p in layout.unit_params(u)) * reduce_bytes for u in unit_names),
                          default=0) if fsdp else 0,
        recv_buffers=recv, held_activations=held, freed_before_blocks=min(tail.values()),
        block_transient=block_transient + max(unsharded.values(), default=0), loss_transient=loss,
        optimizer_scratch=0 if offload else scratch,
    )
    moments = pipeline_moments(sizes)
    where = " (host: CPU offload)" if offload else ""
    mode = ac.mode if ac.mode != "selective" else f"selective {ac.selective_option}"
    sharding = _sharding_text(layout)
    in_flight = ", ".join(f"stage {sid} {per_stage[sid]}" for sid in stage_ids)
    terms = [
        MemoryTerm("parameters", params, f"fp32 master weights of the rank's stages, {sharding}{where}"),
        MemoryTerm("optimizer states", states, _optimizer_text(low_bit) + where),
        MemoryTerm("buffers", layout.buffer_bytes, f"fp32 rotary table, one per stage module ({len(stages)})"),
        MemoryTerm("gradients", grads, f"fp32, {sharding}{where}"),
        MemoryTerm("accumulated unsharded grads", sizes.accumulated_grads,
                   f"FSDP gradients summed over the {pipe.n_microbatches} micro-batches in "
                   f"{str(precision.reduce_dtype).removeprefix('torch.')}, reduce-scattered after the last"
                   if fsdp else "no FSDP: .grad accumulates in place"),
        MemoryTerm("optimizer step scratch", scratch, scratch_how),
        MemoryTerm("activations in flight", held,
                   f"AC {mode}: at most {most} micro-batches held at once ({in_flight}), {s.tokens} tokens each, "
                   f"{param_bytes}-byte compute; the last stage's logits and loss log-probs included"),
        MemoryTerm("block backward transient", sizes.block_transient,
                   "one block's recomputation + activation gradients + fresh unsharded gradients"),
        MemoryTerm("loss backward transient", loss, "fp32 gradients in and out of log-softmax of one micro-batch"
                   if loss else "no last stage on this rank"),
        MemoryTerm("pipeline receive buffers", recv,
                   f"{pipe.n_microbatches} micro-batches x (input activations unless first + output gradient "
                   f"unless last) per stage, {_mib(_boundary_bytes(s))} each"),
        *_moe_terms(layout, s, low_bit),
        MemoryTerm("FSDP gathered params", gathered, _gathered_text(run, fsdp, layout)),
        MemoryTerm("autocast weight copies", sizes.autocast_copies,
                   f"{param_bytes}-byte copy of each non-float8 Linear weight" if s.autocast else "no autocast"),
        MemoryTerm("float8 casts", float8, "float8 operands of the largest converted Linear, in the transient"
                   if float8 else "no float8 Linears"),
    ]
    if run.device_type == "cuda":
        terms.append(MemoryTerm("CUDA context", CUDA_CONTEXT_BYTES, "outside the caching allocator (constant)"))
    return MemoryEstimate(terms=tuple(terms), moments=tuple(moments),
                          layout=f"{dims.describe()} (world size {run.world_size})", device_type=run.device_type,
                          world_size=run.world_size, model=layout.counts.describe() if layout.counts else "",
                          all_gather=layout.all_gather_text, pp_rank=pp_rank,
                          stages="; ".join(st.describe() for st in stages))


def _awaiting_weight_bytes(s: ActivationSetup, stage: StageLayout) -> int:
    """What a micro-batch holds on ``stage`` between its I and W passes (ZBVZeroBubble, DualPipeV):
    ``stage_backward_input`` (torch/distributed/pipelining/_backward.py) keeps the autograd graph
    (retain_graph=True), so every block's full saved set stays, the recomputed one under AC included, plus the
    gradients at the nodes where the weight paths branch off: here one per Linear output (q, k, v, wo, w1,
    w3, w2 of a dense block; an approximation for MoE blocks). The first norm of each block saves the block
    input itself. Measured on the CPU (tests/distributed/test_pipeline_memory_measured.py) this is within 3%
    without activation checkpointing; with it the rank's peak comes out 13-25% higher than estimated here
    (what the checkpoint's recomputation keeps between the two passes is not modelled)."""
    linear_outputs = s.tokens * ((s.hq + 2 * s.hkv) * s.head_dim + 2 * s.ffn + 2 * s.dim) * s.compute_bytes
    blocks = sum(sum(block_saved_bytes(s, int(b)).values()) + linear_outputs for b in stage.blocks)
    return blocks + (_held_loss_bytes(s) + head_saved_bytes(s) if stage.last else _boundary_bytes(s))


def _boundary_bytes(s: ActivationSetup) -> int:
    """One micro-batch of the residual stream between stages (sequence-sharded under SP): what a stage sends,
    receives, and keeps as its output until the backward."""
    return s.tokens // s.sp * s.dim * s.residual_bytes


def _held_loss_bytes(s: ActivationSetup) -> int:
    """What the last stage keeps per in-flight micro-batch beyond the head: the schedule computes the loss in
    the forward action and keeps the output (the logits) and the loss graph (float32 log-probs; a compiled loss
    keeps nothing more) until that micro-batch's backward."""
    return s.tokens * s.vocab * s.compute_bytes + (0 if s.compiled_loss else 4 * s.tokens * s.vocab)


# --------------------------------------------------------------------------------------------------
# Dtypes and setup


def _activation_setup(run: ResolvedRun, layout: ModelLayout) -> ActivationSetup:
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


def _gathered_bytes(layout: ModelLayout, unit: str, param_bytes: int) -> int:
    return sum(math.ceil(p.tp_numel * (p.gather_itemsize or param_bytes))
               for p in layout.unit_params(unit))


def _grad_numel(p: ParamLayout, fsdp: bool) -> int:
    # FSDP turns a replicated gradient back into its shard before the reduce-scatter; without FSDP it is
    # stored as the replicated .grad.
    return p.global_numel if p.replicated_grad and not fsdp else p.local_numel


def _unsharded_grad_bytes(layout: ModelLayout, unit: str, s: ActivationSetup, fsdp: bool, param_bytes: int) -> int:
    params = layout.unit_params(unit)
    if fsdp:
        # FSDP2's unsharded gradients in param_dtype; foreach_reduce then copies them into a fresh
        # reduce_dtype buffer for the reduce-scatter (`foreach_reduce_scatter_copy_in`, _fsdp_collectives.py).
        return sum(p.global_numel if p.replicated_grad else p.tp_numel for p in params) * param_bytes
    if s.autocast:
        # The gradient of autocast's low-precision weight copy, before it is cast into the fp32 .grad.
        return sum(p.tp_numel for p in params if p.is_linear and not p.casts_master_weight) * param_bytes
    return 0


def _autocast_copies(layout: ModelLayout, s: ActivationSetup) -> int:
    if not s.autocast:
        return 0
    return sum(lin.tp_numel for lin in layout.linears if not lin.casts_master_weight) * s.compute_bytes


def _float8_cast_bytes(layout: ModelLayout, s: ActivationSetup) -> int:
    converted = [lin for lin in layout.linears if lin.converted]
    # One Linear at a time: its float8 input (T x in), output gradient (T x out) and weight, 1 byte each
    # (MX adds one e8m0 scale byte per 32 elements, under 4%). Not modelled: the CPU torch._scaled_mm
    # upcasts its operands to float32 internally, and emulated MX dequantizes them to the compute dtype.
    return max((s.tokens * (lin.in_features + lin.out_features) + lin.tp_numel for lin in converted), default=0)


def _gathered_text(run: ResolvedRun, fsdp: bool, layout: ModelLayout) -> str:
    if not fsdp:
        return "no FSDP"
    policy = run.fsdp_reshard_after_forward
    float8 = ", float8 all-gather" if layout.float8_all_gather else ""
    return f"reshard_after_forward={policy}{float8}"


# --------------------------------------------------------------------------------------------------
# Text


def _sharding_text(layout: ModelLayout) -> str:
    dims = layout.dims
    parts = [f"TP {dims.tp}"] if dims.tp_enabled else []
    if dims.fsdp_enabled and dims.dp_shard > 1:
        parts.append(f"FSDP {dims.dp_shard}")
    text = "sharded " + " x ".join(parts) if parts else "not sharded"
    if dims.ep_enabled:
        expert_fsdp = f" x FSDP {dims.expert_fsdp_degree}" if dims.fsdp_enabled and dims.expert_fsdp_degree > 1 else ""
        text += f"; routed experts EP {dims.ep}{expert_fsdp}"
    return text


def _moe_terms(layout: ModelLayout, s: ActivationSetup, low_bit: str | None) -> list[MemoryTerm]:
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


def _optimizer_text(low_bit: str | None) -> str:
    if low_bit is None:
        return "2 x fp32 moments + step"
    return f"torchao {low_bit}: 2 x (codes + fp32 block scales) + step; fp32 below 4096 elements"


def _mib(nbytes: int) -> str:
    return f"{nbytes / 1024**2:.1f} MiB"


def estimate_memory_text(run: ResolvedRun) -> str:
    """The estimate of the resolved run as a table."""
    if run.pipeline is not None:
        return _pipeline_text(run)
    est = estimate_run_memory(run)
    # Blocks differ only by how many activations remain: show the largest block moments.
    blocks = [m for m in est.moments if m.name.startswith("block ")]
    moments = [m for m in est.moments if not m.name.startswith("block ")]
    moments[3:3] = [max((m for m in blocks if m.name.endswith(kind)), key=lambda m: m.nbytes)
                    for kind in ("backward", "reduce-scatter")]
    return _table(est, moments)


def _pipeline_text(run: ResolvedRun) -> str:
    """Every pipeline rank's peak and stages, then the breakdown of the largest rank."""
    ranks = estimate_pipeline_ranks(run)
    largest = max(ranks, key=lambda e: e.peak_allocated)
    assert run.pipeline is not None
    lines = [f"pipeline: {run.pipeline.describe()}; per pipeline rank (every rank of the same pp coordinate "
             "holds the same stages):"]
    for est in ranks:
        mark = "  <- largest" if est is largest else ""
        lines.append(f"  pp rank {est.pp_rank}: peak {est.peak_allocated / GIB:8.3f} GiB allocated, "
                     f"{est.total / GIB:8.3f} GiB per device; {est.stages}{mark}")
    lines.append(f"largest: pp rank {largest.pp_rank} ({largest.stages}), {largest.total / GIB:.3f} GiB per device")
    return "\n".join([*lines, "", _table(largest, list(largest.moments))])


def _table(est: MemoryEstimate, moments: list[Moment]) -> str:
    peak = est.peak_moment
    rows = [(t.name, t.nbytes, t.how) for t in est.terms]
    moment_rows = [(f"at {m.name}", m.nbytes, "<- peak" if m is peak else "") for m in moments]
    breakdown = ", ".join(f"{k} {v / GIB:.2f}" for k, v in peak.parts.items() if v)
    summary = [("peak allocated", est.peak_allocated, f"at {peak.name}: {breakdown} GiB")]
    if est.device_type == "cuda":
        summary.append(("total per device", est.total, "peak allocated + CUDA context; compare with nvidia-smi"))
    width = max(len(r[0]) for r in rows + moment_rows + summary)

    def line(name: str, nbytes: int, how: str) -> str:
        return f"{name:<{width}}  {nbytes / GIB:>9.3f}  {nbytes:>17,}  {how}".rstrip()

    return "\n".join([
        f"memory estimate per rank{'' if est.pp_rank is None else f' (pp rank {est.pp_rank})'}: {est.layout}, "
        f"{est.device_type}"
        + ("" if est.device_type == "cuda" else " (this machine; CUDA runs differ: estimate on the GPU host)"),
        f"model: {est.model}",
        f"{'component':<{width}}  {'GiB':>9}  {'bytes':>17}  how",
        *(line(*r) for r in rows),
        f"{'step moments':<{width}}  device bytes allocated where the peak can occur",
        *(line(*r) for r in moment_rows),
        *(line(*r) for r in summary),
        *([est.all_gather] if est.all_gather else []),
    ])
