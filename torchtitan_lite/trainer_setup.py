"""What the trainer builds or reports once, from its config sections and the parts it has built: the random
seeds, the data order shared by the ranks, the validator, the FP8 statistics collector, the resumed data
layout report, the converters' description and the resolved config file."""
from __future__ import annotations

import logging
import os
import random
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn

from torchtitan_lite.components.checkpoint.layout import write_text_atomically
from torchtitan_lite.components.checkpoint.run_config import RUN_CONFIG_NAME
from torchtitan_lite.components.data import TextDataLoader
from torchtitan_lite.components.data.layout import RESUME_REPORTED_ENV, DataLayout, resume_changes
from torchtitan_lite.components.data.sequence_layout import SequenceLayout
from torchtitan_lite.components.precision import Precision
from torchtitan_lite.components.quantization.fp8_stats import Fp8StatsCollector
from torchtitan_lite.components.tokenizer import Tokenizer
from torchtitan_lite.components.validate import Validator
from torchtitan_lite.config import Configurable, config_to_toml
from torchtitan_lite.config.sections import DebugConfig, TrainingConfig
from torchtitan_lite.distributed.step_runner import LossFn, StepRunner
from torchtitan_lite.distributed.tensor_parallel import loss_parallel_context
from torchtitan_lite.mesh.parallel_dims import ParallelDims
from torchtitan_lite.resolved_run import ResolvedRun

logger = logging.getLogger("torchtitan_lite")


def set_determinism(seed: int | None, debug: DebugConfig) -> None:
    if seed is not None:
        # Same seed on every rank: the model is initialised identically before sharding takes effect.
        torch.manual_seed(seed)
        random.seed(seed)
    if debug.deterministic:
        torch.use_deterministic_algorithms(True)
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.autograd.set_detect_anomaly(debug.detect_anomaly)


def data_order_seed(seed: int | None) -> int | None:
    """training.seed, or without one a random seed drawn by rank 0: the ranks read one shared order."""
    if seed is not None or not dist.is_initialized():
        return seed
    drawn = [int.from_bytes(os.urandom(4), "big")]
    dist.broadcast_object_list(drawn, src=0)
    return drawn[0]


def build_validator(validation: Validator.Config, data: TextDataLoader.Config, training: TrainingConfig, *,
                    tokenizer: Tokenizer, parallel_dims: ParallelDims, vocab_size: int, loss_fn: LossFn,
                    device: torch.device, dp_group: dist.ProcessGroup | None, precision: Precision,
                    loss_parallel: bool, runner: StepRunner, sequence_layout: SequenceLayout) -> Validator | None:
    if not validation.enable:
        return None
    from torchtitan_lite.components.data.mixture_loader import validation_loaders

    runtime = dict(tokenizer=tokenizer, dp_rank=parallel_dims.dp_rank,
                   dp_world_size=parallel_dims.dp_degree, seq_len=training.seq_len,
                   local_batch_size=training.local_batch_size, seed=training.seed,
                   vocab_size=vocab_size)
    # A fresh pass per validation; a mixture validates each source's held-out split on its own.
    factories = validation_loaders(data, **runtime) if data.sources else {
        "": lambda: data.build(split="validation", infinite=False, **runtime)}
    # Built once now: a validation store that is missing, corrupt or of another tokenizer stops the run
    # before training (and the cache's store is written before the first step, not in the middle).
    for factory in factories.values():
        factory()
    sources = {"source_factories": factories, "source_weights": {s.name: s.weight for s in data.sources}} \
        if data.sources else {"dataloader_factory": factories[""]}
    return validation.build(
        **sources, loss_fn=loss_fn, device=device,
        dp_group=dp_group, autocast=precision.eval_autocast,
        loss_context=lambda: loss_parallel_context(loss_parallel),
        runner=runner, sequence_layout=sequence_layout,
    )


def build_fp8_stats(model_parts: Sequence[nn.Module], *, freq: int,
                    dp_group: dist.ProcessGroup | None) -> Fp8StatsCollector | None:
    if freq == 0:
        return None
    return Fp8StatsCollector(model_parts, freq=freq, dp_group=dp_group)


def report_resumed_layout(saved: DataLayout | None, run: ResolvedRun, data: TextDataLoader.Config, *, step: int,
                          data_loaded: bool, global_batch_set: bool) -> None:
    """What resuming changed in how data is fed, unless run_train.sh's check said it before the launch."""
    if saved is None:
        return
    notes, warnings = resume_changes(
        saved, run.data_layout(data), step=step,
        data_loaded=data_loaded,
        global_batch_set=global_batch_set)
    if os.environ.get(RESUME_REPORTED_ENV) == "1":
        return  # run_train.sh's check printed them before the launch
    for note in notes:
        logger.info("%s", note)
    for warning in warnings:
        logger.warning("%s", warning)


def describe_converters(converters: list) -> str:
    """'float8 tensorwise' for each converter config (its recipe where it has one), or 'none'."""
    from torchtitan_lite.config.field_types import kind_of

    names = [" ".join(filter(None, (kind_of(c), getattr(c, "recipe_name", None)))) for c in converters]
    return ", ".join(names) or "none"


def save_resolved_config(config: Configurable.Config, *, dump_folder: str) -> None:
    os.makedirs(dump_folder, exist_ok=True)
    path = os.path.join(dump_folder, RUN_CONFIG_NAME)
    write_text_atomically(path, config_to_toml(config))
    logger.info("resolved config saved to %s", path)
