"""Pipeline parallelism for unmodified models, run by ``torch.distributed.pipelining`` schedules.

``apply`` keeps this rank's stages of a module (``plan.py`` decides the cut, pure functions);
``PipelineEngine`` runs a training step through the schedule behind an unchanged ``training_step``. The schedule
tables and ``check``/``check_microbatches`` judge the pipeline options before any process starts; ``timeline``
plays a schedule's own action lists (the docs' figures, the planner's tests).
"""

from lightning_mgpu.parallel.pipeline.checks import check, check_microbatches, check_options
from lightning_mgpu.parallel.pipeline.microbatches import microbatch_count_error
from lightning_mgpu.parallel.pipeline.plan import (
    LOOP_SCHEDULES,
    PIPELINE_SCHEDULES,
    SINGLE_STAGE_SCHEDULES,
    V_SCHEDULES,
    bubble_fraction,
    check_stage_count,
    plan_split,
    stage_indices,
    stage_owner,
    stages_per_rank,
)
from lightning_mgpu.parallel.pipeline.split import PipelineRuntime, apply
from lightning_mgpu.parallel.pipeline.step import PipelineEngine, PipelinePrecision
from lightning_mgpu.parallel.pipeline.timeline import Timeline, timeline

__all__ = [
    "LOOP_SCHEDULES",
    "PIPELINE_SCHEDULES",
    "SINGLE_STAGE_SCHEDULES",
    "V_SCHEDULES",
    "PipelineEngine",
    "PipelinePrecision",
    "PipelineRuntime",
    "Timeline",
    "apply",
    "bubble_fraction",
    "check",
    "check_microbatches",
    "check_options",
    "check_stage_count",
    "microbatch_count_error",
    "plan_split",
    "stage_indices",
    "stage_owner",
    "stages_per_rank",
    "timeline",
]
