"""Validation loss: the training loss definition on held-out data, without gradients.

The value is the token-weighted mean over every validation batch of every data-parallel rank,
``sum(loss sums) / sum(target tokens)``, exactly how the training loss is normalised, so the two
curves are comparable. Every call starts the validation data from its beginning, so values at
different steps are measured on the same tokens.

A mixture (data.sources) validates each source's held-out split on its own: ``last_by_source`` holds each
source's loss, and the returned loss is their mean weighted by the mixture weights, the loss of the
distribution training reads (not of however many validation tokens each source happens to hold).

``low_precision`` decides what the FP8 / MX Linears of a converted model compute: as in training
(True), or ``nn.Linear.forward`` on the same weights, i.e. the precision section's policy without the
converter (False); the remaining ops follow ``precision.mixed_precision_eval`` either way.
"""
from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from torchtitan_lite.components.data.sequence_layout import SequenceLayout
from torchtitan_lite.components.quantization.low_precision_linears import high_precision_linears
from torchtitan_lite.config import Configurable
from torchtitan_lite.distributed.step_runner import LocalRunner, LossFn, StepRunner

logger = logging.getLogger("torchtitan_lite")

Batch = tuple[torch.Tensor, torch.Tensor]
ContextFactory = Callable[[], AbstractContextManager]


class Validator(Configurable):
    """Runs the model over the validation split and returns the loss."""

    @dataclass(kw_only=True)
    class Config(Configurable.Config):
        enable: bool = False
        """Compute the validation loss during training (every freq steps)."""
        freq: int = 100
        """Validate every this many training steps."""
        steps: int = 20
        """Validation batches per rank per validation; -1 runs the whole (finite) validation split."""
        low_precision: bool = True
        """Validate with the FP8 / MX Linears of a model converter computing as in training (True), or in
        the high-precision policy (False): those Linears then run as plain Linears in precision.param_dtype,
        exactly what the unconverted model computes from the same weights. Not possible with FSDP float8
        all-gather or float8 tensor-parallel communication, which hand the Linears float8 data. The
        dtype of the other ops is precision.mixed_precision_eval's choice."""

        def __post_init__(self) -> None:
            if self.freq < 1:
                raise ValueError(f"validation.freq must be >= 1, got {self.freq}")
            if self.steps == 0 or self.steps < -1:
                raise ValueError(
                    f"validation.steps must be a positive number of batches or -1 for the whole split, got {self.steps}"
                )

    config: Validator.Config

    def __init__(
        self,
        config: Validator.Config,
        *,
        loss_fn: LossFn,
        device: torch.device | str,
        dataloader_factory: Callable[[], Iterable[Batch]] | None = None,
        dataloader: Iterable[Batch] | None = None,
        dp_group: dist.ProcessGroup | None = None,
        autocast: ContextFactory | None = None,
        loss_context: ContextFactory | None = None,
        runner: StepRunner | None = None,
        source_factories: Mapping[str, Callable[[], Iterable[Batch]]] | None = None,
        source_weights: Mapping[str, float] | None = None,
        sequence_layout: SequenceLayout | None = None,
    ) -> None:
        """
        Args:
            loss_fn: ``(logits, labels) -> (loss_sum, n_tokens)``, the training loss.
            device: where batches go for the forward.
            dataloader_factory: returns a fresh validation loader (of ``(inputs, labels)``) per call.
            dataloader: alternatively, an iterable that starts from its beginning on every ``iter()``.
            dp_group: the ranks holding different tokens (data x context parallel) to sum losses and tokens over;
                None for one such rank.
            autocast: returns the context the forward runs in (e.g. ``Precision.eval_autocast``).
            loss_context: returns the context around forward and loss (e.g. tensor-parallel loss_parallel).
            runner: runs each batch's forward (``eval``) and names the group its sums are shared over: the
                trainer's step runner (the pipeline's, whose model parts are this rank's stages); without one,
                the single model part runs locally.
            source_factories: instead of one loader, a fresh validation loader per source of a mixture (by
                name), weighted by ``source_weights`` in the returned loss.
            sequence_layout: lays each batch out for the model as training does (document masking); default
                plain causal attention.
        """
        self.config = config
        if sum(x is not None for x in (dataloader_factory, dataloader, source_factories)) != 1:
            raise ValueError("Validator needs exactly one of dataloader_factory=, dataloader= or source_factories=")
        if dataloader is not None:
            fixed = dataloader
            dataloader_factory = lambda: fixed  # noqa: E731
        self.factories: dict[str, Callable[[], Iterable[Batch]]] = \
            dict(source_factories) if source_factories is not None else {"": dataloader_factory}  # type: ignore[dict-item]
        self.weights = {name: float((source_weights or {}).get(name, 1.0)) for name in self.factories}
        self.last_by_source: dict[str, float] = {}
        """Each source's loss at the latest validation (empty without data.sources)."""
        self.loss_fn = loss_fn
        self.device = torch.device(device)
        self.dp_group = dp_group
        self.autocast = autocast or contextlib.nullcontext
        self.loss_context = loss_context or contextlib.nullcontext
        self.runner = runner
        self.sequence_layout = sequence_layout or SequenceLayout()

    def validate(self, model_parts: Sequence[nn.Module], step: int) -> float:
        """Validation loss of the model at training step ``step``; the model's train/eval modes are kept."""
        if len(model_parts) != 1 and self.runner is None:
            raise ValueError(
                f"validation runs a single-module model, got {len(model_parts)} model parts (pipeline stages) "
                "and no step runner to run them"
            )
        runner = self.runner or LocalRunner(model_parts[0], self.loss_fn)
        modes = [part.training for part in model_parts]
        start = time.perf_counter()
        linears = contextlib.nullcontext() if self.config.low_precision else high_precision_linears(model_parts)
        try:
            for part in model_parts:
                part.eval()
            with torch.no_grad(), linears:
                sums = {name: self._sum_over_split(runner, factory) for name, factory in self.factories.items()}
        finally:
            for part, mode in zip(model_parts, modes):
                part.train(mode)
        losses = {}
        for name, (loss_sum, tokens, batches) in sums.items():
            if tokens == 0:
                which = f"source {name!r}'s validation split" if name else "the validation split"
                raise RuntimeError(
                    f"validation at step {step} saw no target tokens ({batches} batches): {which} is empty or all "
                    f"labels are ignored; check the data section's validation split"
                )
            losses[name] = loss_sum / tokens
            logger.debug("validation at step %d%s: %d batches per rank, %d tokens, loss %.4f", step,
                         f" of {name}" if name else "", batches, tokens, losses[name])
        loss = sum(self.weights[n] * v for n, v in losses.items()) / sum(self.weights.values())
        self.last_by_source = {} if "" in losses else losses
        logger.debug("validation at step %d: loss %.4f, %.1fs", step, loss, time.perf_counter() - start)
        return loss

    def _sum_over_split(self, runner: StepRunner, factory: Callable[[], Iterable[Batch]]) -> tuple[float, int, int]:
        # float64: a whole split's summed loss keeps full precision.
        totals = torch.zeros(2, dtype=torch.float64, device=self.device)
        batches = 0
        data = iter(factory())
        while self.config.steps < 0 or batches < self.config.steps:
            batch = next(data, None)
            if not self._every_rank_has(batch is not None) or batch is None:
                break
            mb = self.sequence_layout(batch).to(self.device)
            with self.autocast(), self.loss_context():
                loss_sum, n_tokens = runner.eval(mb.inputs, mb.labels, mb.model_kwargs)
            totals[0] += _full(loss_sum).double()
            totals[1] += _full(n_tokens).double()
            batches += 1
        for group in (self.dp_group, runner.loss_group):
            if group is not None:
                dist.all_reduce(totals, group=group)
        return float(totals[0]), int(totals[1]), batches

    def _every_rank_has(self, has_batch: bool) -> bool:
        # Ranks may hold different numbers of validation batches; all stop at the shortest so that
        # collective forwards (FSDP all-gathers) stay in lockstep.
        if self.dp_group is None:
            return has_batch
        flag = torch.tensor([int(has_batch)], device=self.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=self.dp_group)
        return bool(flag.item())


def _full(t: torch.Tensor) -> torch.Tensor:
    """Plain tensor from a replicated DTensor (the loss under tensor-parallel loss_parallel)."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t
