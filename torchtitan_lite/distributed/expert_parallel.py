"""Expert parallelism of a whole model: every MoE layer of its blocks splits its routed experts over the EP ranks.

The layers do the splitting themselves (``ExpertParallelLayer``, torchtitan_lite/protocols/expert_parallel.py);
this walks the blocks in module order, so the parameters are re-registered, and the state dict is laid out,
as the model built them.
"""
from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from torchtitan_lite.protocols.expert_parallel import ExpertParallelLayer
from torchtitan_lite.protocols.module_names import checkpointed


def expert_parallel_layers(blocks: nn.ModuleDict) -> list[ExpertParallelLayer]:
    """Every expert-parallel layer of ``blocks``, in module order."""
    return [m for block in blocks.values() for m in block.modules() if isinstance(m, ExpertParallelLayer)]


def apply_expert_parallel(blocks: nn.ModuleDict, ep_mesh: DeviceMesh, ep_tp_mesh: DeviceMesh | None = None) -> int:
    """Shard the experts of every MoE layer of ``blocks`` over ``ep_mesh`` (1-D) in place; returns the number of
    layers. ep_tp_mesh: the (ep, tp) mesh, when expert tensor parallelism has split the experts over tp first."""
    layers = expert_parallel_layers(blocks)
    for layer in layers:
        layer.shard_experts(ep_mesh, ep_tp_mesh)
    return len(layers)


def keep_exchanges_for_recompute(blocks: nn.ModuleDict) -> int:
    """After activation checkpointing is applied: the MoE layers of the checkpointed blocks keep their token
    exchanges for the recomputation; the others keep nothing. Returns the number of layers that keep them."""
    kept = 0
    for block in blocks.values():
        kept += sum(layer.keep_exchanges_for_recompute(checkpointed(block))
                    for layer in block.modules() if isinstance(layer, ExpertParallelLayer))
    return kept
