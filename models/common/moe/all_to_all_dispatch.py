"""Token dispatch over an expert-parallel group: each rank holds num_experts / ep experts and the routed
tokens travel to them and back with two all-to-alls.

dispatch: sort this rank's routed rows by (global) expert, exchange the per-expert counts, then the rows;
the received rows arrive grouped by source rank, then by local expert, and are regrouped by local expert
so that the grouped GEMM sees one contiguous group per local expert. combine: undo the regrouping, send
every row back to the rank it came from (the reverse all-to-all), and combine as the local dispatcher does.
The row exchanges are differentiable: their backward is the reverse exchange.

Under activation checkpointing (``save_for_recompute``) the forward keeps what it exchanged (the routing
order, the split sizes and the exchanged rows), and the recomputation in backward replays it: the
recompute neither routes again nor communicates, and its backward still sends the gradients back. Several
forwards of one layer may be in flight before the first backward (a pipeline schedule runs the forwards of
several micro-batches first); their exchanges wait in a queue, and each recomputation takes the oldest:
every schedule this project runs with expert parallelism and checkpointing backpropagates a stage's
micro-batches in the order it ran their forwards (torchtitan_lite/distributed/pipeline/layout.py). Both
methods run eagerly inside a compiled block (the split sizes are host integers a graph cannot hold), so
the compiler graph-breaks around them and compiles the rest.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

from models.common.moe.dispatch import DispatchHandle, LocalTokenDispatcher
from models.common.moe.recompute import recomputing
from torchtitan_lite.protocols.placeholder_forward import in_placeholder_forward


@dataclass
class AllToAllHandle:
    """What ``combine`` needs to return the expert outputs to their ranks and then to token order."""

    local: DispatchHandle
    """The sort of this rank's routed rows by global expert."""
    regroup: torch.Tensor
    """[received rows] position in arrival order (source rank, local expert) of each row in local-expert order."""
    local_counts: torch.Tensor
    """[num_local_experts] int64 rows received per local expert."""
    send_splits: list[int]
    """Rows this rank sent to each EP rank (dispatch) = rows it receives back from each (combine)."""
    recv_splits: list[int]
    """Rows this rank received from each EP rank (dispatch) = rows it sends back to each (combine)."""
    arrived: torch.Tensor | None = None
    """The rows received in dispatch (kept for a recomputation only)."""
    returned: torch.Tensor | None = None
    """The rows received back in combine (kept for a recomputation only)."""
    kept: bool = False
    """Queued for a recomputation (the forward was checkpointed and differentiable)."""


class AllToAllTokenDispatcher:
    """Experts split over the ``group`` ranks in contiguous blocks: rank r holds experts
    [r * num_experts / ep, (r + 1) * num_experts / ep). Not an nn.Module: it holds no parameters.

    save_for_recompute: the blocks are activation-checkpointed; keep each training forward's exchanges until
    its recomputation takes them, oldest first.
    """

    def __init__(self, num_experts: int, group: dist.ProcessGroup, *, save_for_recompute: bool = False) -> None:
        ep = dist.get_world_size(group)
        if num_experts % ep:
            raise ValueError(f"num_experts={num_experts} is not divisible by the expert-parallel degree ep={ep}: "
                             "each rank holds the same number of experts; choose an ep among its divisors")
        self.num_experts = num_experts
        self.ep = ep
        self.num_local_experts = num_experts // ep
        self.group = group
        self.save_for_recompute = save_for_recompute
        self._local = LocalTokenDispatcher(num_experts)
        self._saved: deque[AllToAllHandle] = deque()
        """Exchanges of the forwards whose recomputation has not run yet, oldest first."""

    @torch.compiler.disable
    def dispatch(self, x: torch.Tensor, experts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, AllToAllHandle]:
        """x [T, dim], experts [T, k] -> (rows received for the local experts, sorted by local expert;
        tokens per local expert [num_local_experts] int64; handle)."""
        # A pipeline schedule's shape-inference pass keeps nothing and replays nothing (it may recompute only
        # some stages), and routes placeholder values: it exchanges like a forward without checkpointing.
        keep = self.save_for_recompute and not in_placeholder_forward()
        saved = self._saved.popleft() if keep and recomputing() and self._saved else None
        if saved is not None:
            if saved.local.order.numel() != experts.numel():
                raise RuntimeError(
                    f"expert-parallel recomputation of {experts.shape[0]} tokens found the exchange of a forward of "
                    f"{saved.local.order.numel() // saved.local.top_k}: backward ran the micro-batches in another order "
                    "than their forwards, which activation checkpointing with expert parallelism cannot replay")
            rows = x[saved.local.order // saved.local.top_k]
            arrived = _Replay.apply(rows, saved.arrived, saved.recv_splits, saved.send_splits, self.group)
            return arrived[saved.regroup], saved.local_counts, saved
        rows, counts, local = self._local.dispatch(x, experts)
        with torch.no_grad():
            # received[s * L + e]: rows rank s sends to this rank's local expert e.
            received = funcol.wait_tensor(funcol.all_to_all_single(counts, None, None, self.group))
        by_source = received.view(self.ep, self.num_local_experts)
        send_splits = counts.view(self.ep, self.num_local_experts).sum(dim=1).tolist()
        recv_splits = by_source.sum(dim=1).tolist()
        arrived = _exchange(rows, recv_splits, send_splits, self.group)
        # Arrival order is (source rank, local expert); a stable sort by (local expert, source rank) groups the
        # rows per local expert and keeps each source's rows in its own order (deterministic sums).
        segment = torch.repeat_interleave(torch.arange(received.numel(), device=received.device), received,
                                          output_size=sum(recv_splits))
        regroup = torch.argsort((segment % self.num_local_experts) * self.ep + segment // self.num_local_experts,
                                stable=True)
        handle = AllToAllHandle(local=local, regroup=regroup, local_counts=by_source.sum(dim=0),
                                send_splits=send_splits, recv_splits=recv_splits)
        if keep and torch.is_grad_enabled():
            handle.arrived = arrived.detach()
            handle.kept = True
            self._saved.append(handle)
        return arrived[regroup], handle.local_counts, handle

    @torch.compiler.disable
    def combine(self, y: torch.Tensor, handle: AllToAllHandle, weights: torch.Tensor) -> torch.Tensor:
        """Expert outputs y (rows as ``dispatch`` returned them) and combine weights [T, k] -> [T, dim]."""
        arrival_order = torch.empty_like(y).index_copy_(0, handle.regroup, y)
        if handle.returned is not None and recomputing():
            returned = _Replay.apply(arrival_order, handle.returned, handle.send_splits, handle.recv_splits, self.group)
        else:
            returned = _exchange(arrival_order, handle.send_splits, handle.recv_splits, self.group)
            if handle.kept:
                handle.returned = returned.detach()
        return self._local.combine(returned, handle.local, weights)


def _exchange(rows: torch.Tensor, output_splits: list[int], input_splits: list[int],
              group: dist.ProcessGroup) -> torch.Tensor:
    """A differentiable all_to_all_single of rows: the backward sends the gradients the reverse way."""
    return funcol.wait_tensor(funcol.all_to_all_single_autograd(rows, output_splits, input_splits, group))


class _Replay(torch.autograd.Function):
    """The result of an exchange the forward already made, returned without communicating; the backward is
    the exchange's backward (the gradients go back to the ranks the rows came from)."""

    @staticmethod
    def forward(ctx: Any, rows: torch.Tensor, result: torch.Tensor, output_splits: list[int],
                input_splits: list[int], group: dist.ProcessGroup) -> torch.Tensor:
        ctx.splits, ctx.group = (output_splits, input_splits), group
        return result.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        output_splits, input_splits = ctx.splits
        back = funcol.wait_tensor(funcol.all_to_all_single(grad.contiguous(), input_splits, output_splits, ctx.group))
        return back, None, None, None, None
