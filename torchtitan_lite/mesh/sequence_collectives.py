"""The collectives of context parallelism, which the models' attention and MoE layers call.

Every rank of a CP group holds its own chunks of each sequence (its
queries), and attention needs the keys and values of the whole sequence, so K and V are all-gathered along the
sequence dimension. All-gather rather than ring or all-to-all because it needs no sharding rule for the attention
kernel (torch's ring path has none for CPU attention) and keeps each rank's attention one plain call over the
whole K/V; the gathered K/V are Hkv heads (before any repeat), or MLA's compressed latent, so the bytes stay small.

They live in the low mesh package (torch only) because the model families call them and import no higher layer.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.distributed._functional_collectives as funcol
from torch.distributed import ProcessGroup


class _GatherSequence(torch.autograd.Function):
    """Forward: all-gather along dim 1, rank-major. Backward: every rank's gradient for the whole sequence,
    summed over the group and scattered back to each chunk's owner (reduce-scatter): the gathered K/V of one
    rank feed every rank's attention, so its gradient is the sum of theirs."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
        ctx.group = group
        # The collective concatenates along dim 0: put the sequence there and back.
        gathered = funcol.all_gather_single(x.movedim(1, 0).contiguous(), 0, group)
        return funcol.wait_tensor(gathered).movedim(0, 1)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        summed = funcol.reduce_scatter_single(grad.movedim(1, 0).contiguous(), "sum", 0, ctx.group)
        return funcol.wait_tensor(summed).movedim(0, 1), None


def gather_sequence(x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    """``x`` [B, s, ...] (this rank's s tokens) -> [B, cp * s, ...]: the ranks' chunks in group-rank order
    (the order sequence_layout's kv_index describes). The gradient of each rank's chunk is the sum of every
    rank's gradient for it. Without a group (cp=1) ``x`` itself, untouched."""
    if group is None:
        return x
    return _GatherSequence.apply(x, group)


class _SumOverSequence(torch.autograd.Function):
    """Forward: all-reduce (sum). Backward: the gradient as it is. For a statistic summed over a sequence whose
    tokens are spread over the CP ranks: every rank then holds the whole sequence's value and computes the same
    function of it, and each rank's backward reaches only its own tokens, so the ranks' gradients, summed by
    FSDP over the CP group, are the one-rank gradient exactly once."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
        return funcol.wait_tensor(funcol.all_reduce(x.contiguous(), "sum", group))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


def sum_over_sequence(x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    """``x`` summed over the CP group (each rank's part of a per-sequence sum); the gradient passes through
    unchanged (see _SumOverSequence). Without a group ``x`` itself."""
    if group is None:
        return x
    return _SumOverSequence.apply(x, group)
