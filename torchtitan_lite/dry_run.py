"""Dry run at cluster size: the real build and parallelize step of N ranks, in one CPU process.

Rank 0 of a world of N joins a fake process group (torch's ``fake`` backend: collectives complete at once
and move nothing), builds the meshes, builds the model on the meta device, converts it (float8) and runs
the family's parallelize function exactly as the trainer would: TP / SP / loss parallel, float8 TP
styles, activation checkpointing, compile wrapping, FSDP / HSDP. What comes out are real DTensor shards
(on meta), so the per-rank parameter, gradient and optimizer bytes below are read off the shards, not
computed on paper; the memory estimate is printed beside them. First come the model's total and active
parameters with the training FLOPs per token that MFU counts, and for an MoE family its expert layout
(experts per EP rank, the FSDP degree over them). The expert shards are whatever the family's parallelize
function makes of ``parallelism.ep``; where it shards the experts by FSDP over all of dp_shard instead, the
bytes per rank are the same as EP x FSDP over dp_shard / ep whenever the degrees divide.

Under pipeline parallelism every pipeline coordinate holds other stages, so one rank of each is built: the
model (a deepcopy of the meta model, cheap) is cut into that rank's stages and each stage parallelized by the
trainer's own ``parallelized_parts`` (model_parts.py); ranks whose stages have the same shape
are built once. Each rank's shard bytes are printed beside its estimate (memory/estimate.py sizes every
pipeline rank and names the largest).
"""
from __future__ import annotations

import contextlib
import copy
import time
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from torchtitan_lite.components.quantization import fp8_plan_summary, low_precision_plan
from torchtitan_lite.distributed.pipeline import StageLayout
from torchtitan_lite.distributed.tensor_parallel import tp_communication_text
from torchtitan_lite.memory.context_parallel import context_parallel_setup
from torchtitan_lite.memory.estimate import GIB, estimate_memory_text, estimate_ranks
from torchtitan_lite.memory.estimate_table import mib
from torchtitan_lite.memory.layout import MASTER_WEIGHT_BYTES
from torchtitan_lite.memory.optimizer_states import state_bytes
from torchtitan_lite.model_parts import build_meta_model, parallelized_parts
from torchtitan_lite.protocols.model_size import expert_layout_text, param_counts
from torchtitan_lite.resolved_run import ResolvedRun

if TYPE_CHECKING:
    from torchtitan_lite.components.precision import Precision
    from torchtitan_lite.protocols.model import BaseModel
    from torchtitan_lite.protocols.parallelize import ParallelizeContext


def dry_run_text(run: ResolvedRun, precision_config: Precision.Config, *, detail: bool = False) -> str:
    """Build and parallelize ``run`` for rank 0 of its world (under a pipeline: one rank of every pipeline
    coordinate) over a fake process group; the report. The FP8 plan in a few summary lines, or with ``detail``
    (--dry-run-detail) its tables: a row per Linear and expert weight, hundreds of lines for a large model."""
    start = time.perf_counter()
    plan = run.model_spec.parallel_plan
    dims, args, seq_len = run.parallel_dims, run.model_args, run.seq_len
    with _fake_world(run.world_size):
        dims.build_mesh("cpu")
        model = build_meta_model(run)
        plan_text = _float8_text(run, model, detail=detail)
        counts = param_counts(model, run.moe_facts, blocks=plan.blocks, embedding=plan.embedding)
        flops = model.flops_per_token(seq_len)  # what the trainer's MFU counts, from the same model
        context = run.parallelize_context(mp_policy=precision_config.build(device="cpu",
                                                                            resolved=run.precision).mp_policy())
        if run.pipeline is None:
            shards = [_shard_bytes(parallelized_parts(model, run, (0,), context), run)]
        else:
            shards = _pipeline_shard_bytes(model, run, context)
    seconds = time.perf_counter() - start
    width = 22
    which = "rank 0" if run.pipeline is None else f"one rank of each of the {dims.pp} pipeline coordinates"
    lines = [
        f"dry run: {which} of {run.world_size}, {dims.describe()}, built and parallelized on meta "
        f"over a fake process group in {seconds:.1f}s",
        f"model: {counts.describe()}; {flops:,} training FLOPs per token at seq_len {seq_len} (MFU counts these)",
        *([expert_layout_text(run.moe_facts, n_layers=args.n_layers, ep=dims.ep, dp_shard=dims.dp_shard,
                              fsdp=dims.fsdp_enabled, tp=dims.tp, cp=dims.cp)] if run.moe_facts is not None else []),
        f"precision: {run.precision.describe()}; {run.n_microbatches} micro-batch(es) of "
        f"{run.tokens_per_microbatch} tokens per step" + ("" if run.pipeline is None else
                                                         f", each cut into {run.pipeline.n_microbatches} pipeline "
                                                         f"micro-batches of {run.pipeline.microbatch_size * seq_len}"),
        *_context_parallel_text(run),
    ]
    for rank_shards, estimate in zip(shards, estimate_ranks(run), strict=True):
        if estimate.pp_rank is None:
            lines.append("per-rank bytes read off the DTensor shards (estimate's own figure in brackets):")
        else:
            lines.append(f"pp rank {estimate.pp_rank} ({estimate.stages}): bytes read off the DTensor shards "
                         f"(estimate's own figure in brackets); estimated peak {estimate.peak_allocated / GIB:.3f} "
                         f"GiB allocated, {estimate.total / GIB:.3f} GiB per device:")
        for name, estimated in (("parameters", estimate.parameters), ("gradients", estimate.gradients),
                                ("optimizer states", estimate.optimizer_states)):
            nbytes = rank_shards[name]
            lines.append(f"  {name:<{width}} {nbytes / GIB:>9.3f} GiB  {nbytes:>17,}  [{estimated:,}]")
    lines += ["", plan_text, "", estimate_memory_text(run)]
    return "\n".join(lines)


def _context_parallel_text(run: ResolvedRun) -> list[str]:
    """Under context parallelism, what a rank holds of each sequence and what it gathers per layer."""
    cp = context_parallel_setup(run)
    if cp is None or cp.cp == 1:
        return []
    return [f"CP {cp.cp}: {cp.local_tokens} tokens per rank of each {cp.seq_len}-token sequence (2 x {cp.cp} "
            f"head-tail chunks), K/V gathered {mib(cp.gather_bytes())}/layer ({cp.gathered_width} channels per "
            "token, all-gathered along the sequence, reduce-scattered in backward)"]


def _pipeline_shard_bytes(model: BaseModel, run: ResolvedRun, context: ParallelizeContext) -> list[dict[str, int]]:
    """Per pipeline rank, the shard bytes of its stages, cut and parallelized as the trainer does it. Ranks
    whose stages have the same shape (as many blocks of the same kinds, the same ends) are built once: the
    middle ranks of a long pipeline differ only in which blocks they hold."""
    layout = run.pipeline
    assert layout is not None
    built: dict[tuple[object, ...], dict[str, int]] = {}
    per_rank = []
    for rank in range(layout.pp):
        stage_ids = layout.stage_ids(rank)
        key = tuple(_stage_shape(layout.stages[i], run) for i in stage_ids)
        if key not in built:
            built[key] = _shard_bytes(parallelized_parts(copy.deepcopy(model), run, stage_ids, context), run)
        per_rank.append(built[key])
    return per_rank


def _stage_shape(stage: StageLayout, run: ResolvedRun) -> tuple[object, ...]:
    facts = run.moe_facts
    kinds = tuple(facts is not None and int(b) in facts.layers for b in stage.blocks)
    return stage.first, stage.last, kinds


@contextlib.contextmanager
def _fake_world(world_size: int) -> Iterator[None]:
    if dist.is_initialized():
        raise RuntimeError("--dry-run runs in a single process: launch it without torchrun")
    # Importing the module registers the 'fake' backend.
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _shard_bytes(parts: Sequence[nn.Module], run: ResolvedRun) -> dict[str, int]:
    local = [(p.to_local() if isinstance(p, DTensor) else p).numel() for part in parts for p in part.parameters()]
    params = sum(local) * MASTER_WEIGHT_BYTES
    return {
        "parameters": params,
        # FSDP reduce-scatters gradients into the parameters' shards and their dtype (float32).
        "gradients": params,
        "optimizer states": sum(state_bytes(n, run.optimizer_low_bit) for n in local),
    }


def _float8_text(run: ResolvedRun, model: nn.Module, *, detail: bool) -> str:
    """The FP8 plan of the converted model (its summary, or with ``detail`` its tables) and, under TP, what each
    communication region moves."""
    converters = run.converters.converters
    if detail:
        text = low_precision_plan(converters, model, seq_len=run.seq_len)
    else:
        summary = fp8_plan_summary(converters, model)
        # The summary points at the tables; here they are one flag away, inside this same report.
        text = None if summary is None else summary.replace(": --print-fp8-plan", ": --dry-run-detail")
    if text is None:
        return "no FP8 converter: every Linear runs in the precision above"
    if run.parallel_dims.tp_enabled:
        text += "\n" + tp_communication_text(run.model_spec.parallel_plan, model, tp=run.parallel_dims.tp,
                                              high_precision=run.precision.param_dtype)
    return text
