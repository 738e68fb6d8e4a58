"""Token dispatch: bring each (token, chosen expert) pair to its expert and the results back.

``LocalTokenDispatcher`` keeps every expert on this rank: it sorts the T * top_k routed copies of the
tokens by expert and undoes the sort afterwards. An all-to-all dispatcher over an expert-parallel mesh
implements the same two methods, exchanging the sorted rows between ranks, and the MoE layer does not
change: it only ever sees (rows sorted by local expert, tokens per local expert) and a handle to combine.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch


def tokens_per_expert(experts: torch.Tensor, num_experts: int) -> torch.Tensor:
    """int64 [num_experts] count of each id in ``experts``. A scatter-add, not torch.bincount: bincount's
    output length depends on the values, which torch.compile cannot trace into one graph."""
    flat = experts.reshape(-1)
    return torch.zeros(num_experts, dtype=torch.int64, device=flat.device).scatter_add_(0, flat, torch.ones_like(flat))


@dataclass(frozen=True)
class DispatchHandle:
    """What ``combine`` needs to put the expert outputs back in token order."""

    order: torch.Tensor
    """[T * top_k] position in the flattened (token, slot) list of each sorted row."""
    num_tokens: int
    top_k: int


class TokenDispatcher(Protocol):
    """What the MoE layer calls: ``dispatch`` returns the rows for the experts this rank holds, sorted by
    (local) expert, with their counts; ``combine`` returns the expert outputs to token order, weighted."""

    def dispatch(self, x: torch.Tensor, experts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, Any]: ...

    def combine(self, y: torch.Tensor, handle: Any, weights: torch.Tensor) -> torch.Tensor: ...


class LocalTokenDispatcher:
    """All experts on this rank. Not an nn.Module: it holds no state, so swapping it moves no weights."""

    def __init__(self, num_experts: int) -> None:
        self.num_experts = num_experts

    def dispatch(self, x: torch.Tensor, experts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, DispatchHandle]:
        """x [T, dim], experts [T, k] -> (rows [T * k, dim] sorted by expert, tokens per expert [E] int64, handle).

        The sort is stable, so within an expert the rows keep token order (deterministic results).
        """
        num_tokens, top_k = experts.shape
        flat = experts.reshape(-1)
        order = torch.argsort(flat, stable=True)
        counts = tokens_per_expert(flat, self.num_experts)
        return x[order // top_k], counts, DispatchHandle(order=order, num_tokens=num_tokens, top_k=top_k)

    def combine(self, y: torch.Tensor, handle: DispatchHandle, weights: torch.Tensor) -> torch.Tensor:
        """Expert outputs y [T * k, dim] (sorted) and combine weights [T, k] -> [T, dim] in y's dtype.

        Unsorting with a gather and summing the k slots (instead of a scatter-add) keeps the sum order fixed:
        bitwise reproducible on every device. The weighted sum runs in float32.
        """
        unsorted = torch.empty_like(y).index_copy_(0, handle.order, y)
        slots = unsorted.view(handle.num_tokens, handle.top_k, -1).float()
        return (slots * weights.unsqueeze(-1)).sum(dim=1).to(y.dtype)
