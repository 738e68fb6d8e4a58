"""How a rank runs one batch through its model parts: the trainer and the validator call a step runner and never
ask whether there is a pipeline.

Two runners share the interface. ``LocalRunner`` holds the whole model (one part): forward, loss, backward.
``PipelineRunner`` (distributed/pipeline/runner.py) holds this rank's pipeline stages and lets the schedule run
the micro-batches. Both normalise each batch's summed loss by the step's global target-token count, so the
gradients are the global mean whatever the layout; what differs is captured by three facts the callers read:
how many forwards a batch costs (the MoE balance loss is weighted by it), and over which group the loss, which
only the last stage computes under a pipeline, is shared.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch
import torch.distributed as dist
from torch import nn

LossFn = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
"""(logits, labels) -> (summed loss, target tokens), e.g. cross_entropy_sum."""
Objective = Callable[[torch.Tensor], torch.Tensor]
"""Maps a normalised loss to what is differentiated (the FP16 loss scaler's scaling)."""
ModelKwargs = dict[str, torch.Tensor]
"""Keyword tensors of the model's forward beside the tokens (positions, query / key indices and documents)."""


class StepRunner(Protocol):
    loss_fn: LossFn
    """The training loss of every forward from now on (assignable)."""
    forwards_per_batch: int
    """Model forwards per local batch: 1, or the pipeline's micro-batches."""
    loss_group: dist.ProcessGroup | None
    """The ranks over which a batch's loss is summed so that each holds it (the pipeline's); None: it is local."""

    def step(self, inputs: torch.Tensor, labels: torch.Tensor, *, global_tokens: torch.Tensor,
             objective: Objective | None = None, model_kwargs: ModelKwargs | None = None) -> torch.Tensor:
        """Forward and backward of one local batch, gradients accumulated; the batch's summed loss divided by
        ``global_tokens`` (zero on a pipeline rank without the last stage). ``model_kwargs``: the batch's sequence
        layout for the model's forward (components/data/sequence_layout.py)."""
        ...

    def eval(self, inputs: torch.Tensor, labels: torch.Tensor,
             model_kwargs: ModelKwargs | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Forward only: (summed loss, target tokens) of the batch (zeros on a pipeline rank without the last
        stage)."""
        ...


class LocalRunner:
    """The step runner of a rank holding the whole model."""

    forwards_per_batch = 1
    loss_group: dist.ProcessGroup | None = None

    def __init__(self, model: nn.Module, loss_fn: LossFn) -> None:
        self.model = model
        self.loss_fn = loss_fn

    def step(self, inputs: torch.Tensor, labels: torch.Tensor, *, global_tokens: torch.Tensor,
             objective: Objective | None = None, model_kwargs: ModelKwargs | None = None) -> torch.Tensor:
        logits = self.model(inputs, **(model_kwargs or {}))
        loss_sum, _ = self.loss_fn(logits, labels)
        loss = loss_sum / global_tokens
        del logits  # the logits are the largest activation: freed before the backward allocates its own
        (objective(loss) if objective is not None else loss).backward()
        return loss.detach()

    def eval(self, inputs: torch.Tensor, labels: torch.Tensor,
             model_kwargs: ModelKwargs | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        return self.loss_fn(self.model(inputs, **(model_kwargs or {})), labels)


def share_loss(loss: torch.Tensor, runner: StepRunner) -> torch.Tensor:
    """``loss`` summed over the runner's loss group in place (every pipeline rank then holds the last stage's);
    unchanged without one."""
    if runner.loss_group is not None:
        dist.all_reduce(loss, group=runner.loss_group)
    return loss
