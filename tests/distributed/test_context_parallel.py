"""gather_sequence on 2 gloo ranks: forward is the ranks' chunks concatenated along the sequence in rank order,
backward gives each rank the sum of every rank's gradient for its own chunk; without a group it is the identity."""
from __future__ import annotations

import torch
import torch.distributed as dist
from _harness import run_ranks

from torchtitan_lite.mesh.sequence_collectives import gather_sequence

B, S, H, D = 2, 3, 2, 4


def _chunk(rank: int) -> torch.Tensor:
    return torch.randn(B, S, H, D, generator=torch.Generator().manual_seed(100 + rank))


def _weight(rank: int, world_size: int) -> torch.Tensor:
    """Rank ``rank``'s weighting of the gathered sequence: its loss's gradient with respect to it."""
    return torch.randn(B, world_size * S, H, D, generator=torch.Generator().manual_seed(200 + rank))


def _worker(rank: int, world_size: int) -> dict:
    x = _chunk(rank).requires_grad_()
    gathered = gather_sequence(x, dist.group.WORLD)
    (gathered * _weight(rank, world_size)).sum().backward()
    return {"gathered": gathered.detach(), "grad": x.grad}


def test_gather_sequence_concatenates_forward_and_reduce_scatters_backward():
    world_size = 2
    results = run_ranks(_worker, world_size)
    whole = torch.cat([_chunk(r) for r in range(world_size)], dim=1)
    summed = sum(_weight(r, world_size) for r in range(world_size))
    for rank, result in enumerate(results):
        assert torch.equal(result["gathered"], whole)
        assert torch.allclose(result["grad"], summed[:, rank * S:(rank + 1) * S], rtol=0, atol=1e-6)
        # Not merely this rank's own weight: the other rank's gradient reached it.
        assert not torch.allclose(result["grad"], _weight(rank, world_size)[:, rank * S:(rank + 1) * S])


def test_without_a_group_it_is_the_identity():
    x = torch.randn(B, S, H, D, requires_grad=True)
    assert gather_sequence(x, None) is x
