"""The all-to-all token dispatcher against the local one, on 2 gloo ranks with planted routing: uneven loads,
a rank that sends nothing to the other rank's experts, and an expert no token chose (empty splits)."""
from __future__ import annotations

import torch
import torch.distributed as dist
from _harness import run_ranks

from models.common.moe.all_to_all_dispatch import AllToAllTokenDispatcher
from models.common.moe.dispatch import LocalTokenDispatcher
from models.common.moe.experts import GroupedExperts

DIM, HIDDEN, EXPERTS, TOKENS = 16, 32, 4, 6
# [rank][token] -> 2 experts. Rank 0 keeps to its own experts 0 and 1; expert 3 (rank 1's) gets no token.
ROUTING = [
    [[0, 1], [1, 0], [0, 1], [1, 0], [0, 1], [0, 1]],
    [[2, 0], [1, 2], [2, 1], [0, 2], [2, 0], [1, 2]],
]


def _compare(rank: int, world_size: int) -> dict[str, float]:
    torch.manual_seed(0)
    full = GroupedExperts(DIM, HIDDEN, EXPERTS)
    full.init_weights(out_proj_std=0.02)
    xs = torch.randn(world_size, TOKENS, DIM)
    combine_weights = torch.rand(world_size, TOKENS, 2)
    x = xs[rank].clone().requires_grad_(True)
    experts = torch.tensor(ROUTING[rank])

    # Reference: every expert on this rank, the local dispatcher.
    local = LocalTokenDispatcher(EXPERTS)
    rows, counts, handle = local.dispatch(x, experts)
    expected = local.combine(full(rows, counts), handle, combine_weights[rank])
    expected.pow(2).sum().backward()
    expected_x_grad = x.grad.clone()
    ref_grads = torch.stack([full.w1.grad, full.w2.grad.transpose(1, 2), full.w3.grad])
    dist.all_reduce(ref_grads)  # every rank's tokens contribute to each expert's gradient
    x.grad = None

    # EP 2: this rank's two experts, the all-to-all dispatcher.
    mine = slice(2 * rank, 2 * rank + 2)
    sliced = GroupedExperts(DIM, HIDDEN, EXPERTS // world_size)
    with torch.no_grad():
        for name in ("w1", "w2", "w3"):
            getattr(sliced, name).copy_(getattr(full, name)[mine])
    dispatcher = AllToAllTokenDispatcher(EXPERTS, dist.group.WORLD)
    rows, counts, handle = dispatcher.dispatch(x, experts)
    got = dispatcher.combine(sliced(rows, counts), handle, combine_weights[rank])
    got.pow(2).sum().backward()
    got_grads = torch.stack([sliced.w1.grad, sliced.w2.grad.transpose(1, 2), sliced.w3.grad])
    return {
        "local_counts": counts.tolist(),
        "out": float((got - expected).abs().max()),
        "x_grad": float((x.grad - expected_x_grad).abs().max()),
        "expert_grads": float((got_grads - ref_grads[:, mine]).abs().max()),
        "grad_scale": float(ref_grads[:, mine].abs().max()),
    }


def test_all_to_all_dispatch_equals_local_dispatch_with_empty_splits():
    rank0, rank1 = run_ranks(_compare, 2, timeout_s=120)
    # Tokens per local expert, summed over the sources: experts 0, 1 get 6 + 3 and 6 + 3; expert 2 gets 6,
    # expert 3 none.
    assert rank0["local_counts"] == [9, 9] and rank1["local_counts"] == [6, 0]
    for result in (rank0, rank1):
        # float32; the same rows through the same weights, only the grouping of the GEMMs and the order of
        # the gradient sums differ: 1e-6 of values of order 1e-2 .. 1.
        assert result["out"] <= 1e-6 and result["x_grad"] <= 1e-6
        assert result["grad_scale"] > 0 and result["expert_grads"] <= 1e-6 * max(1.0, result["grad_scale"])
