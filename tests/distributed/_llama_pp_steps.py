"""A 2-block Llama 3 (the debug flavor's widths) trained for a few steps under a pipeline as the trainer builds and
steps it: ``resolve_run`` on a Trainer.Config, ``build_model_parts`` (converters, stage cut, parallelize per stage,
PipelineRunner), one optimizer per part with the converters' post-optimizer hook on it (the float8 scale
precompute, per stage), and ``Trainer.train_step``'s loss semantics (micro-batch losses over the step's global
target tokens, summed over the pipeline and the data-parallel ranks). Every run loads the same initial weights
and reads the same global batches (tests/distributed/_llama_steps.py), so a pipeline must train as one process.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
from _collectives import CollectiveLog
from _llama_steps import GLOBAL_BATCH, LR, MAX_NORM, SEQ, global_batches
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict

from torchtitan_lite.batch_sums import sum_over
from torchtitan_lite.components.loss import IGNORE_INDEX, cross_entropy_sum
from torchtitan_lite.components.optimizer import OptimizersContainer
from torchtitan_lite.components.precision import Precision
from torchtitan_lite.components.quantization.float8 import Float8LinearConverter
from torchtitan_lite.config.sections import (
    ActivationCheckpointConfig,
    CompileConfig,
    ModelConfig,
    ParallelismConfig,
    TrainingConfig,
)
from torchtitan_lite.distributed.compile import compiled_graphs, maybe_compile_loss
from torchtitan_lite.distributed.grad_clip import clip_grad_norm_
from torchtitan_lite.distributed.step_runner import share_loss
from torchtitan_lite.distributed.tensor_parallel import local_loss, loss_parallel_context
from torchtitan_lite.model_parts import build_model_parts
from torchtitan_lite.protocols.model_converter import ModelConvertersContainer
from torchtitan_lite.resolved_run import resolve_run
from torchtitan_lite.trainer import Trainer

N_LAYERS = 2
"""One block per stage at PP 2."""
RECORD_STEP = 1
"""The step whose collectives are logged: the second, the first after a scale precompute."""


@dataclass(frozen=True)
class PPRun:
    pp: int = 1
    dp_shard: int = 1
    tp: int = 1
    accumulation: int = 1
    """Gradient-accumulation micro-batches per rank (training.global_batch_size): the reference of a pipeline
    whose micro-batches are smaller than the batch."""
    float8: bool = False
    """float8 tensorwise; under FSDP with the float8 all-gather and precomputed scales."""
    fp8_all_gather: bool = True
    precompute: bool = True
    compile: bool = False
    """Blocks and loss compiled with aot_eager (dynamo + AOT autograd, no code generation)."""
    ac_mode: str = "none"
    steps: int = 3

    @property
    def world_size(self) -> int:
        return self.pp * self.dp_shard * self.tp


def config(run: PPRun) -> Trainer.Config:
    converters = [Float8LinearConverter.Config(
        recipe_name="tensorwise", filter_fqns=["output"], enable_fsdp_float8_all_gather=run.fp8_all_gather,
        precompute_float8_dynamic_scale_for_fsdp=run.fp8_all_gather and run.precompute)] if run.float8 else []
    return Trainer.Config(
        model=ModelConfig(flavor="debug", n_layers=N_LAYERS),
        training=TrainingConfig(steps=run.steps, seq_len=SEQ, local_batch_size=GLOBAL_BATCH // run.dp_shard // run.accumulation,
                                global_batch_size=GLOBAL_BATCH, max_norm=MAX_NORM, seed=0),
        precision=Precision.Config(param_dtype="float32", reduce_dtype="float32"),
        optimizer=OptimizersContainer.Config(lr=LR, weight_decay=0.1),
        parallelism=ParallelismConfig(pp=run.pp, dp_shard=run.dp_shard, tp=run.tp),
        activation_checkpoint=ActivationCheckpointConfig(mode=run.ac_mode),
        compile=CompileConfig(enable=run.compile, backend="aot_eager"),
        model_converters=ModelConvertersContainer.Config(converters=converters),
    )


def initial_state_dict(resolved) -> dict[str, torch.Tensor]:
    """One process's initial weights of the model (whatever part of it this rank holds)."""
    torch.manual_seed(0)
    model = resolved.model_spec.model_cls(resolved.model_args)
    model.init_weights()
    return {k: v.clone() for k, v in model.state_dict().items()}


def train(rank: int, world_size: int, run: PPRun) -> dict:
    """Per-step losses and grad norms, the collectives of RECORD_STEP ('fwd_bwd', and 'optimizer' with the hooks
    after it), the parts' block types and whether they were compiled, the graphs dynamo compiled."""
    cfg = config(run)
    resolved = resolve_run(cfg, world_size=world_size, device_type="cpu", vocab_size=256)
    dims = resolved.parallel_dims
    dims.build_mesh("cpu")
    precision = cfg.precision.build(resolved=resolved.precision, device=torch.device("cpu"))
    graphs_before = compiled_graphs()
    loss_fn = maybe_compile_loss(cross_entropy_sum, enabled=resolved.compile_loss, backend=resolved.compile_backend)
    built = build_model_parts(resolved, mp_policy=precision.mp_policy(), device=torch.device("cpu"), loss_fn=loss_fn,
                              seed=0, label="llama3 debug")
    parts, runner = built.parts, built.runner
    initial = initial_state_dict(resolved)
    for part in parts:
        own = get_model_state_dict(part).keys()
        set_model_state_dict(part, {k: v for k, v in initial.items() if k in own},
                             options=StateDictOptions(full_state_dict=True))
    optimizers = cfg.optimizer.build(model_parts=parts)
    # As the trainer registers it: the float8 scales of each part refreshed after that part's optimizer step.
    for part, optimizer in zip(parts, optimizers, strict=True):
        optimizer.register_step_post_hook(lambda *_, part=part: resolved.converters.post_optimizer_hook([part]))
    batch_group = dims.batch_mesh.get_group() if dims.batch_mesh is not None else None
    params = [p for part in parts for p in part.parameters()]
    rows = resolved.local_batch_size
    out: dict = {"losses": [], "grad_norms": [], "collectives": {}}
    for step, (global_inputs, global_labels) in enumerate(global_batches(run.steps)):
        global_tokens = (global_labels != IGNORE_INDEX).sum().float()
        # Logged under float8 only: dynamo refuses to trace under a dispatch mode.
        log = CollectiveLog() if step == RECORD_STEP and run.float8 else None
        loss_total = torch.zeros(())
        for i in range(resolved.n_microbatches):
            first = (dims.dp_rank * resolved.n_microbatches + i) * rows
            inputs, labels = global_inputs[first:first + rows], global_labels[first:first + rows]
            with log or contextlib.nullcontext(), precision.autocast(), loss_parallel_context(resolved.loss_parallel):
                loss = runner.step(inputs, labels, global_tokens=global_tokens)
            loss_total += local_loss(loss)
        grad_norm = clip_grad_norm_(params, MAX_NORM, pp_mesh=dims.pp_mesh)
        loss_total = sum_over(share_loss(loss_total, runner), batch_group)
        if log is not None:
            out["collectives"]["fwd_bwd"] = list(log.calls)
            log = CollectiveLog()
        with log or contextlib.nullcontext():
            optimizers.step()
        if log is not None:
            out["collectives"]["optimizer"] = list(log.calls)
        optimizers.zero_grad()
        out["losses"].append(float(loss_total))
        out["grad_norms"].append(float(grad_norm))
    out["graphs"] = compiled_graphs() - graphs_before
    out["blocks"] = [(type(block).__name__, block._compiled_call_impl is not None)
                     for part in parts for block in part.layers.values()]
    out["tp_sharded"] = any(getattr(p, "device_mesh", None) is not None and "tp" in (p.device_mesh.mesh_dim_names or ())
                            for p in params)
    return out


def train_runs(rank: int, world_size: int, runs: list[PPRun]) -> list[dict]:
    return [train(rank, world_size, run) for run in runs]
