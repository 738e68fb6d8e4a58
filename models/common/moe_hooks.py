"""Model-wide forms of the MoE layer's trainer-facing calls: every MoE layer of a model, found by type."""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from models.common.moe import MoE


def moe_layers(model: nn.Module) -> list[MoE]:
    return [m for m in model.modules() if isinstance(m, MoE)]


def moe_aux_loss(model: nn.Module) -> torch.Tensor | None:
    """Sum of the layers' coefficient-weighted balance losses from the latest training forward; None when
    no layer has one. Each layer's loss is consumed: a second call without a forward in between returns None."""
    losses = [loss for layer in moe_layers(model) if (loss := layer.take_aux_loss()) is not None]
    return torch.stack(losses).sum() if losses else None


def update_expert_biases(model: nn.Module, group: dist.ProcessGroup | None = None) -> None:
    """update_expert_bias on every MoE layer (after an optimizer step that applied)."""
    for layer in moe_layers(model):
        layer.update_expert_bias(group)
