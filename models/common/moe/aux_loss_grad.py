"""How an auxiliary loss computed inside a layer (the MoE balance loss) reaches the gradients: attached to the
layer's output, not returned to the trainer.

``attach_aux_loss(out, aux, scale)`` is the identity on ``out``; its backward passes ``out``'s gradient through
and adds the gradient of ``scale * aux`` to ``aux``'s graph (d(scale * aux) / d aux = scale, whatever the
gradient arriving at ``out``). The objective is thus the language-model loss plus ``scale`` times every
attached loss, without the trainer ever holding those losses. This is what makes the balance loss work
under pipeline parallelism, where the schedule runs forward and backward itself and a middle stage has no
loss to add anything to; it works the same way without a pipeline, so there is one mechanism.

``scale`` is a tensor (the MoE layer's ``aux_loss_scale`` buffer, which the trainer sets once per step): a
compiled block reads it as a graph input, so a new value (the FP16 loss scale moves) recompiles nothing.
"""
from __future__ import annotations

from typing import Any

import torch


class _AttachAuxLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, out: torch.Tensor, aux: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(scale)
        ctx.aux_dtype = aux.dtype
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        (scale,) = ctx.saved_tensors
        return grad, scale.to(ctx.aux_dtype), None


def attach_aux_loss(out: torch.Tensor, aux: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``out`` unchanged; its backward also differentiates ``scale * aux`` (aux a scalar with a graph)."""
    return _AttachAuxLoss.apply(out, aux, scale)
