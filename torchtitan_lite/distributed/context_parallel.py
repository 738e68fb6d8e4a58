"""Context parallelism of a whole model: every layer of its blocks that reads the whole sequence learns its CP group.

Each CP rank holds 2 of the 2 x cp head-tail chunks of every sequence (torchtitan_lite/components/data/
sequence_layout.py) and computes the queries of its own tokens. Attention all-gathers the keys and values over the
group (torchtitan_lite/mesh/sequence_collectives.py), a per-sequence balance statistic sums over it; everything
else in a block is per token and needs nothing. The parameters are replicated over CP and FSDP shards them over
dp_shard x cp, so their gradients are summed over the CP ranks like over data-parallel ones.
"""
from __future__ import annotations

from torch import nn
from torch.distributed import ProcessGroup

from torchtitan_lite.protocols.context_parallel import ContextParallelLayer


def apply_context_parallel(blocks: nn.ModuleDict, group: ProcessGroup) -> int:
    """Give every context-parallel layer of ``blocks`` the CP ``group``; returns the number of layers. A block
    without a context-parallel attention would attend within its rank's chunks only: refused."""
    total = 0
    for key, block in blocks.items():
        layers = [m for m in block.modules() if isinstance(m, ContextParallelLayer)]
        attention = sum(bool(layer.use_context_parallel(group)) for layer in layers)
        if attention == 0:
            raise TypeError(
                f"block {key} ({type(block).__name__}) has no attention that implements ContextParallelLayer "
                "(torchtitan_lite/protocols/context_parallel.py): under parallelism.cp > 1 it would attend only "
                "within its rank's chunks of the sequence; implement use_context_parallel in the family's "
                "attention, or use --parallelism.cp 1")
        total += len(layers)
    return total
