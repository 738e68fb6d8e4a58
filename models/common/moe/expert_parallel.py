"""How an MoE layer's routed experts are split over the EP ranks (``MoE.shard_experts``, which also swaps in the
all-to-all dispatcher; torchtitan_lite/distributed/expert_parallel.py applies it to every MoE layer).

The expert weights become DTensors sharded on dim 0 (the expert dim) over the EP mesh, so a checkpoint
holds the global [num_experts, ...] tensors and DCP reshards it between EP degrees. The router and its
expert bias stay replicated: every rank routes its own tokens over all experts.

Under tensor parallelism as well (expert tensor parallelism has already split every expert's hidden dim
over tp, torchtitan_lite/distributed/expert_tensor_parallel.py), the weights become DTensors on the 2-D
(ep, tp) mesh: Shard(0) over ep, their hidden-dim shard over tp. The TP ranks of one data rank route the
same gathered tokens, so each exchanges them within its own EP group (the ranks of its tp coordinate, which
hold the same hidden slice), computes its slice of its local experts and receives partial outputs back,
which the TP region's reduce-scatter sums as without EP.
"""
from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from models.common.moe.experts import GroupedExperts


def shard_experts(experts: GroupedExperts, ep_mesh: DeviceMesh, ep_tp_mesh: DeviceMesh | None) -> None:
    """Shard ``experts``' weights over ``ep_mesh`` (1-D) on their expert dim, in place (re-registered in their
    order, so the state dict keeps its layout).

    ep_tp_mesh: the (ep, tp) mesh, when the experts are already TP-split DTensors on its tp dim (TP applied
    first); their local blocks then become DTensors on it, without communication.
    """
    for name, param in list(experts.named_parameters(recurse=False)):
        sharded = (_split_tp_experts(param, ep_mesh, ep_tp_mesh) if isinstance(param, DTensor)
                   else distribute_tensor(param, ep_mesh, [Shard(0)]))
        experts.register_parameter(name, nn.Parameter(sharded, requires_grad=param.requires_grad))


def _split_tp_experts(param: DTensor, ep_mesh: DeviceMesh, ep_tp_mesh: DeviceMesh | None) -> DTensor:
    """A TP-split expert weight [E, ...] (one Shard placement on the tp mesh) -> the same global tensor on the
    (ep, tp) mesh, this rank's block of experts of its TP slice: a local slice, no communication (on meta too)."""
    if ep_tp_mesh is None or param.device_mesh.ndim != 1 or len(param.placements) != 1 \
            or not isinstance(param.placements[0], Shard) or param.placements[0].dim == 0:
        raise ValueError(
            f"expert weights already distributed as {param.placements} on mesh {param.device_mesh.mesh_dim_names} "
            "can be split over EP only when expert tensor parallelism split their hidden dim over tp and the "
            "(ep, tp) mesh is given (ParallelDims.ep_tp_mesh)")
    ep, ep_rank = ep_mesh.size(), ep_mesh.get_local_rank()
    local = param.to_local()
    experts = local.shape[0] // ep
    block = local[ep_rank * experts:(ep_rank + 1) * experts].clone()  # not a view pinning the TP slice
    return DTensor.from_local(block, ep_tp_mesh, [Shard(0), param.placements[0]], run_check=False,
                              shape=param.shape, stride=param.stride())

