"""The model a rank trains: built on meta, converted, cut into this rank's pipeline stages (when there is a
pipeline), each part parallelized by the family's plan (distributed/parallelize.py), then materialised and initialised.

``build_model_parts`` is what the trainer calls; the dry run builds and parallelizes with the same
``build_meta_model`` and ``parallelized_parts`` (and reads the same FLOPs per token off the model), the memory
estimate cuts the same stages (``build_stage_modules``, torchtitan_lite/distributed/pipeline/stage_model.py).
"""
from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch.distributed.fsdp import MixedPrecisionPolicy

from torchtitan_lite.components.quantization import fp8_plan_summary
from torchtitan_lite.distributed.parallelize import parallelize
from torchtitan_lite.distributed.pipeline import build_stage_modules
from torchtitan_lite.distributed.pipeline.runner import PipelineRunner
from torchtitan_lite.distributed.step_runner import LocalRunner, LossFn, StepRunner
from torchtitan_lite.mesh import process_groups as dist_utils
from torchtitan_lite.protocols.model import BaseModel
from torchtitan_lite.protocols.model_size import attention_flops_per_token
from torchtitan_lite.protocols.parallelize import ParallelizeContext
from torchtitan_lite.resolved_run import ResolvedRun

logger = logging.getLogger("torchtitan_lite")


@dataclass
class ModelParts:
    parts: list[BaseModel]
    """The whole model, or this rank's pipeline stages in the schedule's order."""
    runner: StepRunner
    """Runs a batch through the parts: the pipeline's schedule over this rank's stages, or the whole model."""
    flops_per_token: int
    """Training FLOPs per token of the whole model (what MFU counts), whatever part this rank holds."""
    attention_flops_per_token: int
    """The part of ``flops_per_token`` the attention scores and their weighted sum take (all earlier tokens of
    the window; MFU scales it by the share a document mask leaves)."""


def build_model_parts(run: ResolvedRun, *, mp_policy: MixedPrecisionPolicy, device: torch.device, loss_fn: LossFn,
                      seed: int | None, label: str) -> ModelParts:
    """Build, convert, cut, parallelize, materialise and initialise this rank's model parts (see the module doc).
    ``seed`` (training.seed) gives each pipeline stage its own initial random stream (``_stage_rng``); ``label``
    names the model in the log ('llama3 debug'). Under FSDP CPU offload the parameters live on the host."""
    model = build_meta_model(run)
    plan = fp8_plan_summary(run.converters.converters, model)
    if plan is not None and dist_utils.is_rank0():
        logger.info("%s", plan)
    flops_per_token = model.flops_per_token(run.seq_len)
    attention_flops = attention_flops_per_token(run.model_args, run.seq_len)
    n_params = model.num_params()
    start = time.perf_counter()
    layout = run.pipeline
    stage_ids = layout.stage_ids(run.parallel_dims.pp_rank) if layout is not None else (0,)
    cpu_offload = run.fsdp_cpu_offload
    parts = parallelized_parts(model, run, stage_ids, run.parallelize_context(mp_policy=mp_policy))
    for part, stage_id in zip(parts, stage_ids, strict=True):
        part.to_empty(device="cpu" if cpu_offload else device)
        with torch.no_grad(), _stage_rng(seed, stage_id, device):
            part.init_weights(buffer_device=device if cpu_offload else None)
        part.train()
    logger.info("model %s: %s params, %.3g FLOPs/token, parallelized in %.1fs", label, f"{n_params:,}",
                flops_per_token, time.perf_counter() - start)
    runner: StepRunner = LocalRunner(parts[0], loss_fn)
    if layout is not None:
        pp_mesh = run.parallel_dims.pp_mesh
        assert pp_mesh is not None  # pp > 1 whenever there is a layout
        runner = PipelineRunner(layout, parts, stage_ids, group=pp_mesh.get_group(), device=device, loss_fn=loss_fn)
        logger.info("%s; this rank runs %s (%s params)", layout.describe(),
                    ", ".join(layout.stages[i].describe() for i in stage_ids), f"{sum(p.num_params() for p in parts):,}")
    return ModelParts(parts=parts, runner=runner, flops_per_token=flops_per_token,
                      attention_flops_per_token=attention_flops)


def build_meta_model(run: ResolvedRun) -> BaseModel:
    """The whole model on the meta device, converted (float8 / MX): what every rank cuts its parts from."""
    with torch.device("meta"):
        model = run.model_spec.model_cls(run.model_args)
    run.converters.convert(model)
    return model


def parallelized_parts(model: BaseModel, run: ResolvedRun, stage_ids: tuple[int, ...],
                       context: ParallelizeContext) -> list[BaseModel]:
    """``model`` cut into the pipeline stages ``stage_ids`` (the whole model without a pipeline), each parallelized by
    the family's plan. The stages are cut out of ``model`` itself: pass a copy to cut it again."""
    spec = run.model_spec
    layout = run.pipeline
    parts = build_stage_modules(model, spec.parallel_plan, layout, stage_ids) if layout is not None else [model]
    return [parallelize(part, spec.parallel_plan, context, label=spec.name) for part in parts]


def _stage_rng(seed: int | None, stage_id: int, device: torch.device) -> contextlib.AbstractContextManager[None]:
    """The random stream pipeline stage ``stage_id`` initialises its weights from. Every rank is seeded alike,
    so without this each stage would draw its first parameters from the numbers stage 0's embedding drew: the
    last stage's output head came out correlated with the embedding (initial loss about 15 instead of 8 on
    llama3_debug). Stage s seeds seed + s inside a forked RNG, so stage 0 (and a run without a pipeline) keeps
    the 1-process stream and the run's stream after the build is unchanged. A pipeline's initial weights
    therefore differ from one process's; runs compared with one process start from one seed checkpoint."""
    if stage_id == 0 or seed is None:
        return contextlib.nullcontext()
    return _seeded_fork(seed + stage_id, device)


@contextlib.contextmanager
def _seeded_fork(seed: int, device: torch.device) -> Iterator[None]:
    """Run the body on the RNG seeded with ``seed`` and give the caller's RNG state back afterwards."""
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(seed)
        yield
