"""The weight of the models' auxiliary loss (MoE balancing) in each forward of a training step.

The balance loss of one forward is a mean over its sequences; the step's objective wants the mean over the global
batch. A rank runs ``n_batches`` forwards (gradient accumulation), a pipeline splits each into its micro-batches,
and the data-parallel ranks' gradients are summed: each forward's balance loss therefore enters with 1 / (batches x
pipeline micro-batches x data-parallel ranks), times the FP16 loss scale as the loss has it. The logged loss stays
the language-model loss alone.

The trainer and the tests that hold parallel layouts against one process (tests/distributed) both weight it
here, so a wrong weight moves the parallel runs' router gradients away from the one-process reference's.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torchtitan_lite.mesh.parallel_dims import ParallelDims
    from torchtitan_lite.protocols.model import BaseModel


def set_aux_loss_weight(model_parts: Sequence[BaseModel], *, n_batches: int, forwards_per_batch: int,
                        parallel_dims: ParallelDims, loss_scale: float = 1.0) -> float:
    """Set the weight on every part (``set_aux_loss_scale``) and return it. ``forwards_per_batch``: the step
    runner's (1, or the pipeline's micro-batches)."""
    n_forwards = n_batches * forwards_per_batch
    weight = loss_scale / (n_forwards * parallel_dims.dp_degree)
    for part in model_parts:
        part.set_aux_loss_scale(weight)
    return weight
