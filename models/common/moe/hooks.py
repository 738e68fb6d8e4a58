"""Model-wide forms of the MoE layer's trainer-facing calls: every MoE layer of a model, found by type."""
from __future__ import annotations

import torch.distributed as dist
from torch import nn

from models.common.moe.layer import MoE


def moe_layers(model: nn.Module) -> list[MoE]:
    return [m for m in model.modules() if isinstance(m, MoE)]


def set_aux_loss_scale(model: nn.Module, scale: float) -> None:
    """Weight every MoE layer's balance loss by ``scale`` in the backward passes to come (until set again)."""
    for layer in moe_layers(model):
        layer.aux_loss_scale.fill_(scale)


def update_expert_biases(model: nn.Module, group: dist.ProcessGroup | None = None) -> None:
    """update_expert_bias on every MoE layer (after an optimizer step that applied)."""
    for layer in moe_layers(model):
        layer.update_expert_bias(group)
