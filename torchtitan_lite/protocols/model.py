"""What the trainer, the parallelisms and the tools need of a model family's top module."""
from __future__ import annotations

import torch
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
