"""compat.dtensor_from_local on two gloo ranks: a replicated input whose gradient is read as a partial sum gets
each rank's own share back, on the installed torch's ``from_local`` and on the autograd step that stands in for
it where ``from_local`` lacks ``grad_placements`` (torch 2.11), so both paths are checked on every release."""
from __future__ import annotations

import torch
from _harness import run_ranks
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate

from torchtitan_lite import compat


def _input_grads(rank: int, world_size: int) -> dict[str, list[float]]:
    """x.grad per path when rank r's loss is (r + 1) * sum(3 * x), read through a partial-sum region as
    replicated_modules.py does (the output's gradient is each rank's share)."""
    mesh = init_device_mesh("cpu", (world_size,))
    paths = {
        "installed": lambda x: compat.dtensor_from_local(x, mesh, (Replicate(),), grad_placements=(Partial(),)),
        "stand_in": lambda x: compat._FromLocalWithGradPlacements.apply(x, mesh, (Replicate(),), (Partial(),)),
        "plain": lambda x: DTensor.from_local(x, mesh, (Replicate(),), run_check=False),
    }
    grads = {}
    for name, wrap in paths.items():
        x = torch.ones(4, requires_grad=True)
        out = (wrap(x) * 3).to_local(grad_placements=(Partial(),))
        ((rank + 1) * out).sum().backward()
        grads[name] = x.grad.tolist()
    return grads


def test_a_replicated_input_read_as_a_partial_sum_gets_each_ranks_share_back():
    ranks = run_ranks(_input_grads, 2)
    for rank, grads in enumerate(ranks):
        share = [3.0 * (rank + 1)] * 4
        assert grads["installed"] == share and grads["stand_in"] == share, (rank, grads)
        # Negative control: from_local's default hands the gradient back replicated, the shares summed.
        assert grads["plain"] == [3.0 * (1 + 2)] * 4, (rank, grads)
