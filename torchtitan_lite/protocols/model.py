"""What the trainer, the parallelisms and the tools need of a model family's top module."""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn


class BaseModel(nn.Module):
    """Top module of a model family: tokens [batch, seq] -> logits [batch, seq, vocab].

    The repeated blocks live in one ModuleDict, named by the family's ``ParallelPlan.blocks``: the parallelisms,
    activation checkpointing, compile and the float8 plan find them there (and wrap them in place), never under a
    fixed attribute name.
    """

    def init_weights(self, buffer_device: torch.device | str | None = None) -> None:
        """Initialise every parameter and buffer (after ``to_empty`` when built on meta)."""
        raise NotImplementedError

    def num_params(self, exclude_embedding: bool = False) -> int:
        raise NotImplementedError

    def flops_per_token(self, seq_len: int) -> int:
        """Training FLOPs (forward + backward) per token at ``seq_len``, attention included."""
        raise NotImplementedError

    def set_aux_loss_scale(self, scale: float) -> None:
        """Weight of the model's auxiliary training loss (e.g. MoE load balancing) in the backward passes to come.

        Each training forward computes its auxiliary loss (already weighted by its coefficient and averaged over
        that forward's sequences) and attaches its gradient, times ``scale``, to its own activations
        (models/common/moe/aux_loss_grad.py): the loss the trainer differentiates and logs is the language-model
        loss alone, with or without a pipeline schedule. The trainer sets 1 / (forwards per optimizer step and
        rank x data-parallel ranks), times the FP16 loss scale, so the step optimises the auxiliary loss's mean
        over the global batch. Until set, 1. No-op for a model without one. Set it before a step's forwards, not
        between a forward and its backward (autograd saves the weight with the forward and refuses a changed one).
        """

    def post_optimizer_step(self, dp_group: dist.ProcessGroup | None) -> None:
        """Called once after every optimizer step that changed the weights (not after one the FP16 scaler
        or the spike policy skipped), e.g. to move MoE expert biases toward balance. ``dp_group``: the
        data-parallel ranks, over which per-rank statistics are summed so replicated state stays equal."""

    def training_stats(self, dp_group: dist.ProcessGroup | None) -> dict[str, torch.Tensor]:
        """Statistics the model gathered over its training forwards since the previous call (e.g. MoE router
        load balance), as TensorBoard tag -> device scalar, reduced over ``dp_group``; each call starts a new
        interval. The trainer calls it at log steps only, on every rank (it may be collective), and reads all
        the values in one transfer. Empty when the model has none."""
        return {}

    def merge_training_stats(self, parts: list[dict[str, float]]) -> dict[str, float]:
        """The read ``training_stats`` of several parts of this model (pipeline stages, each holding some of
        its layers) as the whole model's values. Default: their union."""
        merged: dict[str, float] = {}
        for values in parts:
            merged |= values
        return merged

    def training_stats_summary(self, values: dict[str, float]) -> str | None:
        """A short console form of read ``training_stats`` values, appended to the log line; None: nothing."""
        return None

    def high_precision_parts(self) -> list[tuple[str, str]]:
        """The model's parts that a low-precision Linear recipe leaves in high precision although they compute
        something (not Linears, or Linears a recipe must not take), as (part, why), for --print-fp8-plan."""
        return []
