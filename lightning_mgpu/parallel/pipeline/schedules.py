"""Building torch's pipeline schedules for this rank's stages, once per kind of step.

A schedule is built for each (training or not, microbatch plan, microbatch shapes) a run meets and then reused:
torch infers the shapes a stage sends on a schedule's first step (a trial forward that the runtime must tell from a
real microbatch, see ``_compat.pipelining.stage_class_with_shape_trial``), so a new shape needs a new schedule.
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from contextlib import contextmanager
from typing import TYPE_CHECKING, cast

import torch

from lightning_mgpu._compat.pipelining import forward_only_schedule, stage_class_with_shape_trial
from lightning_mgpu.parallel.pipeline.microbatches import MicrobatchPlan, tensor_leaves
from lightning_mgpu.parallel.pipeline.split import PipelineRuntime, Stage

if TYPE_CHECKING:
    from torch import nn
    from torch.distributed import ProcessGroup

    from lightning_mgpu._compat.pipelining import _PipelineSchedule


class ScheduleCache:
    """This rank's schedules, built on first use; ``loss_fn(output, target)`` is the last stage's loss."""

    def __init__(
        self, runtime: PipelineRuntime, group: ProcessGroup, device: torch.device, loss_fn: Callable[..., torch.Tensor]
    ) -> None:
        self.runtime = runtime
        self.group = group
        self.device = device
        self.loss_fn = loss_fn
        self._stage_class = stage_class_with_shape_trial(_shape_trial)
        self._schedules: dict[tuple, _PipelineSchedule] = {}

    def get(self, plan: MicrobatchPlan, first_microbatch: object, training: bool) -> _PipelineSchedule:
        key = (training, plan, tuple(tuple(t.shape) for t in tensor_leaves(first_microbatch)))
        schedule = self._schedules.get(key)
        if schedule is None:
            schedule = self._schedules[key] = self._build(plan, training)
        return schedule

    def _build(self, plan: MicrobatchPlan, training: bool) -> _PipelineSchedule:
        from torch.distributed.pipelining.schedules import get_schedule_class

        num_stages = self.runtime.num_stages
        stages = [self._stage_class(s, s.index, num_stages, self.device, group=self.group) for s in self.runtime.stages]
        if len(stages) == 1 and not training:
            return forward_only_schedule(stages[0], plan.count)
        schedule_class = get_schedule_class(plan.schedule)
        return schedule_class(
            stages[0] if len(stages) == 1 else stages, plan.count, loss_fn=self.loss_fn, scale_grads=False
        )


@contextmanager
def _shape_trial(submodule: nn.Module) -> Generator[None, None, None]:
    """Mark ``stage`` (a ``pipeline.Stage``) and its runtime as running torch's shape-inference trial.

    The trial is a forward the user did not ask for: every buffer it changes (BatchNorm's running statistics and
    batch counter) is put back afterwards.
    """
    stage = cast(Stage, submodule)  # what the runtime's stages run
    modules = [stage, *(call.module for call in stage.runtime.calls[:1])]
    buffers = {id(b): b for module in modules for b in module.buffers()}
    saved = [(buffer, buffer.clone()) for buffer in buffers.values()]
    stage.inferring = stage.runtime.inferring = True
    try:
        yield
    finally:
        stage.inferring = stage.runtime.inferring = False
        for buffer, value in saved:  # through ``.data``: no version bump that a saved forward would refuse
            buffer.data.copy_(value)
