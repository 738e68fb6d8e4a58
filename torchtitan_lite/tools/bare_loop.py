"""The same training as a registry config, written as a bare hand-written loop: the yardstick for the
trainer's framework overhead.

    python scripts/bare_loop.py --config llama3_debug --warmup 3 --steps 20
    python scripts/bare_loop.py --config llama3_debug_bf16 --steps 5 --json-out bare.json
    python scripts/bare_loop.py --config llama3_debug --steps 40 --against-trainer   # alternate with the trainer

What is the same as the trainer: the model class, flavor and initialisation; the data (the same
tokenizer and packed text loader, iterated inside the timed loop exactly as the trainer's loop does);
the optimizer (torch AdamW/Adam, the same hyperparameters, the same decay / no-decay parameter groups,
and the same kernel choice: fused where the torch build supports the device, else foreach);
gradient-norm clipping at ``training.max_norm``; the precision (float32, or torch.autocast in
``precision.param_dtype``); the float32 cross-entropy.

What is left out, on purpose, because it is the framework: config objects at run time, the LR
schedule (the peak LR is used throughout, which costs nothing either way), metrics, checkpointing,
validation, the preemption watcher, non-finite checks, GC control (Python's automatic GC stays on),
and every per-step host synchronisation (the loss is read once, after the clock stops).

Configs with features this loop does not reproduce (parallelism, FP8 converters, torch.compile,
activation checkpointing, gradient accumulation, FP16 loss scaling, low-bit optimizers) are refused
with the reason, rather than measured as something else.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from torchtitan_lite.components.loss import IGNORE_INDEX
from torchtitan_lite.config.registry import ConfigRegistry


@dataclass(frozen=True)
class BareResult:
    tokens_per_s: float
    steps: int
    elapsed_s: float
    final_loss: float


def unsupported_reason(cfg: Any) -> str | None:
    """Why this loop cannot train ``cfg`` like the trainer would; None when it can."""
    p, t = cfg.parallelism, cfg.training
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 or p.tp > 1 or p.dp_replicate > 1 or p.dp_shard > 1:
        return "parallelism (it is a single-process loop)"
    if cfg.model_converters.converters:
        return "model converters (FP8)"
    if cfg.compile.enable:
        return "torch.compile"
    if cfg.activation_checkpoint.mode != "none":
        return "activation checkpointing"
    if t.global_batch_size not in (-1, t.local_batch_size):
        return "gradient accumulation"
    if cfg.optimizer.low_bit is not None:
        return "low-bit optimizer states"
    if cfg.precision.param_dtype == "float16" or cfg.precision.loss_scaling in ("dynamic", "static"):
        return "FP16 loss scaling"
    return None


def bare_step_fn(cfg: Any, device: torch.device) -> Callable[[], torch.Tensor]:
    """Build the model, data, optimizer and precision of ``cfg``; return one training step as a function."""
    reason = unsupported_reason(cfg)
    if reason is not None:
        raise ValueError(f"the bare loop does not reproduce {reason}; benchmark this config with the trainer only")
    if cfg.training.seed is not None:
        torch.manual_seed(cfg.training.seed)
    model, batches = _model_and_data(cfg, device)
    optimizer = _optimizer(cfg, model)
    compute_dtype = _compute_dtype(cfg, device)
    autocast = (torch.autocast(device.type, dtype=compute_dtype) if compute_dtype != torch.float32
                else contextlib.nullcontext())
    params = [p for p in model.parameters() if p.requires_grad]
    max_norm = cfg.training.max_norm

    def step() -> torch.Tensor:
        inputs, labels = next(batches)
        inputs, labels = inputs.to(device), labels.to(device)
        with autocast:
            logits = model(inputs)
        loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(0, 1), ignore_index=IGNORE_INDEX)
        del logits
        loss.backward()
        if max_norm > 0:
            torch.nn.utils.clip_grad_norm_(params, max_norm, foreach=True)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    return step


def run(cfg: Any, *, warmup: int, steps: int, device: torch.device | None = None) -> BareResult:
    """Train ``cfg`` for ``warmup`` untimed then ``steps`` timed steps; tokens/s of the timed ones."""
    device = device or _default_device()
    step = bare_step_fn(cfg, device)
    for _ in range(warmup):
        step()
    _synchronize(device)
    start = time.perf_counter()
    for _ in range(steps):
        loss = step()
    _synchronize(device)
    elapsed = time.perf_counter() - start
    tokens = steps * cfg.training.local_batch_size * cfg.training.seq_len
    return BareResult(tokens_per_s=tokens / elapsed, steps=steps, elapsed_s=elapsed, final_loss=float(loss))


def run_against_trainer(cfg: Any, *, warmup: int, steps: int) -> tuple[BareResult, BareResult]:
    """(trainer, bare) results of both trained in this process, one step each in turn.

    The trainer step is what the trainer's loop does per step minus its bookkeeping: fetch the
    micro-batches from its data loader, then ``Trainer.train_step``. Alternating the two (ABBA
    order, so neither always runs right after the other) exposes both to the same machine load,
    which separate processes on a shared machine are not. A device sync ends every timed step
    (the trainer's step reads nothing back by itself outside log steps).
    """
    trainer = cfg.build()
    device = trainer.device
    data = iter(trainer.dataloader)

    def trainer_step() -> torch.Tensor:
        loss, _ = trainer.train_step([next(data) for _ in range(trainer.n_microbatches)])
        trainer.pending.read()  # the loop reads its queued values at log steps; this one drops them
        return loss

    steps_by_name = {"trainer": trainer_step, "bare": bare_step_fn(cfg, device)}
    for _ in range(warmup):
        for fn in steps_by_name.values():
            fn()
    elapsed = dict.fromkeys(steps_by_name, 0.0)
    last = {}
    for i in range(steps):
        order = ("trainer", "bare") if i % 2 == 0 else ("bare", "trainer")
        for name in order:
            _synchronize(device)
            start = time.perf_counter()
            last[name] = steps_by_name[name]()
            _synchronize(device)
            elapsed[name] += time.perf_counter() - start
    trainer.close()
    tokens = steps * cfg.training.local_batch_size * cfg.training.seq_len
    trainer_result, bare_result = (
        BareResult(tokens_per_s=tokens / elapsed[name], steps=steps, elapsed_s=elapsed[name],
                   final_loss=float(last[name])) for name in ("trainer", "bare"))
    return trainer_result, bare_result


def _model_and_data(cfg: Any, device: torch.device) -> tuple[nn.Module, Iterator[tuple[torch.Tensor, torch.Tensor]]]:
    from torchtitan_lite.protocols.model_spec import build_model_args, get_model_spec

    tokenizer = cfg.tokenizer.build()
    spec = get_model_spec(cfg.model.name)
    args = build_model_args(spec, cfg.model.flavor, n_layers=cfg.model.n_layers, min_vocab_size=tokenizer.vocab_size,
                            hf_config=cfg.model.hf_config)
    with torch.device("meta"):
        model = spec.model_cls(args)
    model.to_empty(device=device)
    with torch.no_grad():
        model.init_weights()
    model.train()
    loader = cfg.data.build(tokenizer=tokenizer, dp_rank=0, dp_world_size=1, seq_len=cfg.training.seq_len,
                            local_batch_size=cfg.training.local_batch_size, split="train", infinite=True,
                            seed=cfg.training.seed)
    return model, iter(loader)


def _optimizer(cfg: Any, model: nn.Module) -> torch.optim.Optimizer:
    from torch.utils._foreach_utils import _get_fused_kernels_supported_devices

    o = cfg.optimizer
    params = [p for p in model.parameters() if p.requires_grad]
    groups: list[dict] = [{"params": params}]
    if o.no_decay_norms_and_embeddings and o.weight_decay > 0:
        embeddings = {id(p) for m in model.modules() if isinstance(m, nn.Embedding) for p in m.parameters()}
        no_decay = [p for p in params if p.ndim < 2 or id(p) in embeddings]
        skip = {id(p) for p in no_decay}
        groups = [{"params": [p for p in params if id(p) not in skip]}, {"params": no_decay, "weight_decay": 0.0}]
    kernel = o.implementation
    if kernel == "auto":
        kernel = "fused" if next(iter(params)).device.type in _get_fused_kernels_supported_devices() else "foreach"
    flags = {"fused": {"fused": True}, "foreach": {"foreach": True}, "for-loop": {"foreach": False}}[kernel]
    cls = torch.optim.AdamW if o.name == "AdamW" else torch.optim.Adam
    return cls(groups, lr=o.lr, betas=tuple(o.betas), eps=o.eps, weight_decay=o.weight_decay, **flags)


def _compute_dtype(cfg: Any, device: torch.device) -> torch.dtype:
    if cfg.precision.param_dtype != "auto":
        return getattr(torch, cfg.precision.param_dtype)
    # 'auto' depends on the device's bf16 support; the trainer's own rule decides it.
    return cfg.precision.build(device=device, fsdp_enabled=False).param_dtype


def _default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def main(argv: list[str], *, registry: ConfigRegistry) -> int:
    """Time the config selected by ``argv`` (``--config NAME`` from ``registry``) in the bare loop."""
    from torchtitan_lite.library_notices import silence_known_library_notices

    silence_known_library_notices()
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        epilog="Other flags (--config NAME, --section.field VALUE) select and override the config as in train.py.")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps first (default 3)")
    parser.add_argument("--steps", type=int, default=20, help="timed steps (default 20)")
    parser.add_argument("--json-out", help="also write the result as JSON here")
    parser.add_argument("--against-trainer", action="store_true",
                        help="also build the trainer in this process and alternate its steps with the bare ones")
    args, config_argv = parser.parse_known_args(argv)
    if args.warmup < 0 or args.steps < 1:
        parser.error("--warmup must be >= 0 and --steps >= 1")
    os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")
    logging.getLogger("torchao").setLevel(logging.ERROR)

    from torchtitan_lite.config import ConfigError, parse_cli

    try:
        cli = parse_cli(config_argv, registry=registry)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    reason = unsupported_reason(cli.config)
    if reason is not None:
        print(f"error: config '{cli.config_name}' uses {reason}, which the bare loop does not reproduce",
              file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="bare_loop_") as dump:
        if args.against_trainer:
            # Validation off as in scripts/benchmark.py; the trainer's outputs go to a temporary folder.
            cfg = parse_cli(["--validation.enable", "false", "--job.dump_folder", dump, *config_argv],
                            registry=registry).config
            trainer_result, result = run_against_trainer(cfg, warmup=args.warmup, steps=args.steps)
        else:
            trainer_result, result = None, run(cli.config, warmup=args.warmup, steps=args.steps)
    print(f"bare loop {cli.config_name}: {result.tokens_per_s:,.0f} tokens/s over {result.steps} steps "
          f"({result.elapsed_s:.2f}s), final loss {result.final_loss:.4f}")
    if trainer_result is not None:
        print(f"trainer step, alternated with it: {trainer_result.tokens_per_s:,.0f} tokens/s "
              f"({trainer_result.elapsed_s:.2f}s), final loss {trainer_result.final_loss:.4f}; "
              f"trainer / bare = {trainer_result.tokens_per_s / result.tokens_per_s:.3f}")
    if args.json_out:
        from torchtitan_lite.tools.benchmark.measurement import BareMeasurement

        measurement = BareMeasurement(
            config=cli.config_name, tokens_per_s=result.tokens_per_s, steps=result.steps, elapsed_s=result.elapsed_s,
            trainer_tokens_per_s=trainer_result.tokens_per_s if trainer_result else None)
        Path(args.json_out).write_text(json.dumps(measurement.to_json(), indent=2))
    return 0

