"""A pipeline stage's module: the family's own model with the parts of other stages removed.

The stage keeps the family's class and its module names (``layers.7`` stays ``layers.7``), so ``parallelize``
(torchtitan_lite/distributed/parallelize.py) parallelizes it with the family's plan unchanged, its state-dict
keys are the whole model's (a checkpoint saved under any pipeline layout loads under any other), and the HF
adapters read it as they read the whole model. The parts a stage lacks are set to None, which the shared
decoder's forward skips: a stage without the embedding reads the previous stage's hidden states, a stage
without the head returns its own.
"""
from __future__ import annotations

import copy

from torchtitan_lite.distributed.pipeline.layout import PipelineLayout, StageLayout
from torchtitan_lite.protocols.model import BaseModel
from torchtitan_lite.protocols.model_spec import ParallelPlan


def prune_to_stage(model: BaseModel, plan: ParallelPlan, stage: StageLayout) -> BaseModel:
    """Remove from ``model`` (in place) every block, the embedding and the head that ``stage`` does not hold."""
    blocks = getattr(model, plan.blocks)
    for key in [k for k in blocks if k not in stage.blocks]:
        del blocks[key]
    if not stage.first:
        setattr(model, plan.embedding, None)
    if not stage.last:
        setattr(model, plan.final_norm, None)
        setattr(model, plan.output, None)
    return model


def build_stage_modules(model: BaseModel, plan: ParallelPlan, layout: PipelineLayout,
                        stage_ids: tuple[int, ...]) -> list[BaseModel]:
    """One module per stage in ``stage_ids``, each a pruned copy of ``model`` (built on meta, converted);
    ``model`` itself becomes the last of them, so a rank with one stage copies nothing."""
    modules = []
    for position, stage_id in enumerate(stage_ids):
        source = model if position == len(stage_ids) - 1 else copy.deepcopy(model)
        modules.append(prune_to_stage(source, plan, layout.stages[stage_id]))
    return modules
