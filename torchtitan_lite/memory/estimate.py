"""Per-rank memory of a training config, predicted before launch from the config alone.

`estimate_run_memory(run)` takes the resolved run (torchtitan_lite/resolved_run.py: degrees, model args,
precision with 'auto' decided, micro-batches, converters), builds the model on the meta device, lays its
parameters out by the family's parallel plan (TP, then FSDP2 sharding; memory/layout.py), sizes every
component below per rank, and finds the peak over the moments of a training step (memory/timeline.py).
`estimate_memory(config, world_size=N)` resolves the run first.

Components:

  parameters        float32 master weights, sharded by TP and by FSDP (dp_shard x cp); dp_replicate copies them;
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
  CP gathered K/V   under context parallelism (cp > 1; a rank's activations above are its seq_len / cp chunk's):
                    the keys and values of the whole sequence attention saves per block, or under full AC one
                    block's gathered again, with their gradient before the reduce-scatter (memory/context_parallel.py)
  attention mask    when the model gets a mask (cp > 1 or a document mask): a dense float32 matrix on a CPU, a
                    FlexAttention block mask on CUDA, held from forward to the first block's backward
  CUDA context      on CUDA only, `CUDA_CONTEXT_BYTES` that the caching allocator never sees

Under pipeline parallelism every pipeline rank is sized on its own (``estimate_ranks``): the
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
# This module holds the entry points and the one per-rank path: a rank's part of the model is sized in
# rank_sizes.py; its terms and moments in step_rank.py (no pipeline: one stage holding the whole model) or
# pipeline_rank.py; terms.py defines the estimate and estimate_table.py its text.
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from torchtitan_lite.distributed.pipeline.layout import StageLayout
from torchtitan_lite.memory.estimate_table import table
from torchtitan_lite.memory.layout import ModelLayout, model_layout
from torchtitan_lite.memory.pipeline_rank import pipeline_rank
from torchtitan_lite.memory.rank_sizes import activation_setup, rank_sizes
from torchtitan_lite.memory.step_rank import step_rank
from torchtitan_lite.memory.terms import CUDA_CONTEXT_BYTES, GIB, MemoryEstimate, MemoryTerm
from torchtitan_lite.memory.timeline import Moment
from torchtitan_lite.mesh import process_groups as dist_utils
from torchtitan_lite.resolved_run import ResolvedRun, resolve_run

if TYPE_CHECKING:
    from torchtitan_lite.trainer import Trainer

__all__ = ["CUDA_CONTEXT_BYTES", "GIB", "MemoryEstimate", "MemoryTerm", "estimate_memory", "estimate_memory_text",
           "estimate_ranks", "estimate_run_memory"]


def estimate_memory(config: Trainer.Config, *, world_size: int, device_type: str | None = None) -> MemoryEstimate:
    """Predict the per-rank memory of training `config` on `world_size` ranks of `device_type`
    ('cuda' or 'cpu'; default: this machine's)."""
    device_type = device_type or dist_utils.device_type()
    return estimate_run_memory(resolve_run(config, world_size=world_size, device_type=device_type))


def estimate_run_memory(run: ResolvedRun) -> MemoryEstimate:
    """Predict the per-rank memory of the resolved run; under pipeline parallelism, of its largest pipeline
    rank (``estimate_ranks`` gives every rank)."""
    return max(estimate_ranks(run), key=lambda e: e.peak_allocated)


def estimate_ranks(run: ResolvedRun) -> list[MemoryEstimate]:
    """The memory of every pipeline rank (index = pp_rank; one rank without a pipeline). A rank holds its
    stages' units of the family's plan: their blocks, the embedding on the first stage and the final norm +
    output head on the last, each sharded by TP / FSDP / EP; without a pipeline, one stage holding them all.
    One micro-batch is pipeline_microbatch_size samples under a pipeline, the local batch without."""
    full = model_layout(run)
    s = activation_setup(run, full)
    pipe = run.pipeline
    if pipe is None:
        whole = StageLayout(index=0, blocks=full.block_keys, first=True, last=True)
        terms, moments = step_rank(run, s, rank_sizes(run, full, s, [whole]))
        return [_estimate(run, full, terms, moments)]
    estimates = []
    for pp_rank in range(pipe.pp):
        stages = [pipe.stages[i] for i in pipe.stage_ids(pp_rank)]
        terms, moments = pipeline_rank(run, s, rank_sizes(run, full, s, stages), pp_rank)
        estimates.append(_estimate(run, full, terms, moments, pp_rank=pp_rank,
                                   stages="; ".join(st.describe() for st in stages)))
    return estimates


def _estimate(run: ResolvedRun, full: ModelLayout, terms: list[MemoryTerm], moments: list[Moment],
              **rank: Any) -> MemoryEstimate:
    """A rank's estimate: its terms, the CUDA context on CUDA, and its moments."""
    if run.device_type == "cuda":
        terms = [*terms, MemoryTerm("CUDA context", CUDA_CONTEXT_BYTES, "outside the caching allocator (constant)")]
    return MemoryEstimate(terms=tuple(terms), moments=tuple(moments),
                          layout=f"{full.dims.describe()} (world size {run.world_size})", device_type=run.device_type,
                          world_size=run.world_size, model=full.counts.describe() if full.counts else "",
                          all_gather=full.all_gather_text, **rank)


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
    return table(est, moments)


def _pipeline_text(run: ResolvedRun) -> str:
    """Every pipeline rank's peak and stages, then the breakdown of the largest rank."""
    ranks = estimate_ranks(run)
    largest = max(ranks, key=lambda e: e.peak_allocated)
    assert run.pipeline is not None
    lines = [f"pipeline: {run.pipeline.describe()}; per pipeline rank (every rank of the same pp coordinate "
             "holds the same stages):"]
    for est in ranks:
        mark = "  <- largest" if est is largest else ""
        lines.append(f"  pp rank {est.pp_rank}: peak {est.peak_allocated / GIB:8.3f} GiB allocated, "
                     f"{est.total / GIB:8.3f} GiB per device; {est.stages}{mark}")
    lines.append(f"largest: pp rank {largest.pp_rank} ({largest.stages}), {largest.total / GIB:.3f} GiB per device")
    return "\n".join([*lines, "", table(largest, list(largest.moments))])
