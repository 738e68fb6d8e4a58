"""What expert parallelism needs of a model's MoE layers: shard their experts, keep their exchanges.

The models side (models/common/moe/layer.py ``MoE``) satisfies it; the core (torchtitan_lite/distributed/
expert_parallel.py) finds such layers by this shape, so the parallelize sequence never imports a model family.
"""
from __future__ import annotations

from typing import Protocol, runtime_checkable

from torch.distributed.device_mesh import DeviceMesh


@runtime_checkable
class ExpertParallelLayer(Protocol):
    """An MoE layer whose routed experts can be split over expert-parallel ranks."""

    def shard_experts(self, ep_mesh: DeviceMesh, ep_tp_mesh: DeviceMesh | None) -> None:
        """Split the experts over ``ep_mesh`` (1-D) in place and exchange tokens over it from now on.
        ep_tp_mesh: the (ep, tp) mesh, when expert tensor parallelism has already split the experts over tp."""
        ...

    def keep_exchanges_for_recompute(self, keep: bool) -> int:
        """Whether the token exchanges are kept for the recomputation of a checkpointed block (which then
        neither re-routes nor communicates); returns 1 when this layer now keeps them, else 0."""
        ...
