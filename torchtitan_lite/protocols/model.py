"""What the trainer, the parallelisms and the tools need of a model family's top module."""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn


class BaseModel(nn.Module):
    """Top module of a model family: tokens [batch, seq] -> logits [batch, seq, vocab].

    The repeated blocks live in ``layers``: activation checkpointing, compile, TP and FSDP wrap them
    in place there, so every family keeps them in one ModuleDict.
    """

    layers: nn.ModuleDict

    def init_weights(self, buffer_device: torch.device | str | None = None) -> None:
        """Initialise every parameter and buffer (after ``to_empty`` when built on meta)."""
        raise NotImplementedError

    def num_params(self, exclude_embedding: bool = False) -> int:
        raise NotImplementedError

    def flops_per_token(self, seq_len: int) -> int:
        """Training FLOPs (forward + backward) per token at ``seq_len``, attention included."""
        raise NotImplementedError

    def aux_loss(self) -> torch.Tensor | None:
        """Auxiliary training loss of the latest training forward (e.g. MoE load balancing), already weighted
        by its coefficient and averaged over that forward's sequences; None when the model has none.

        The trainer adds it to each micro-batch's loss divided by (micro-batches x data-parallel ranks), so
        the step optimises its mean over the global batch. Reading it consumes it.
        """
        return None

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

    def training_stats_summary(self, values: dict[str, float]) -> str | None:
        """A short console form of read ``training_stats`` values, appended to the log line; None: nothing."""
        return None

    def high_precision_parts(self) -> list[tuple[str, str]]:
        """The model's parts that a low-precision Linear recipe leaves in high precision although they compute
        something (not Linears, or Linears a recipe must not take), as (part, why), for --print-fp8-plan."""
        return []
