"""Pipeline parallelism: stages cut from the family's parallel plan, run by torch.distributed.pipelining."""
from torchtitan_lite.distributed.pipeline.layout import (
    SCHEDULES,
    PipelineLayout,
    ScheduleFacts,
    StageLayout,
    resolve_pipeline,
)
from torchtitan_lite.distributed.pipeline.stage_model import build_stage_modules, prune_to_stage

__all__ = ["SCHEDULES", "PipelineLayout", "ScheduleFacts", "StageLayout", "build_stage_modules", "prune_to_stage",
           "resolve_pipeline"]
