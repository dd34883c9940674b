"""Framework internals the pipeline runtime uses: torch's pipelining (checked on torch 2.13.0) and torchmetrics'
metric state (checked on torchmetrics 1.9.0).

- ``forward_only_schedule``: ``schedules._ScheduleForwardOnly``, the forward-only schedule for one stage per rank.
  Public stand-in: a schedule's ``eval()``, which also runs forwards only but needs a loss function on the last
  stage (the runtime uses it for multi-stage placements).
- ``stage_class_with_shape_trial``: overrides ``PipelineStage._forward_metadata_inference`` and
  ``_backward_metadata_inference``, the trial forward/backward torch runs on a schedule's first step to learn the
  shapes a stage sends. Public stand-in: ``PipelineStage(input_args=..., output_args=...)`` with static shapes,
  which the runtime cannot give: shapes come from the user's batches.

- ``schedule_actions``: ``_schedule_visualizer.get_schedule_ops``, each pipeline rank's actions in the order
  torch's schedule class runs them, built with mock stages (what torch's own schedule plots use). Public stand-in:
  a schedule's ``pipeline_order``, which needs real stages and a process group. The docs' timelines and the
  planner's memory tests read it (``parallel.pipeline.timeline``).

- ``metric_*``: a torchmetrics ``Metric``'s private progress (``_update_count``, ``_forward_cache``, ``_computed``),
  its state names (``_defaults``) and sync flags (``_to_sync``, ``_should_unsync``), which the last stage sends to
  the other stages after each step so that every rank's copy is the same. Public stand-in: ``metric_state`` and
  ``merge_state``, which carry the states but not the update count or the forward value a logged metric shows.

``check()`` (``tests/parallel/pipeline/test_step.py``) fails loudly, naming the internal and the version it was
checked on, when torch renames or drops one of them.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any

from torch import nn
from torch.distributed.pipelining import PipelineStage
from typing_extensions import override

from lightning_mgpu._compat import InternalChanged, changed, internal

if TYPE_CHECKING:
    import torch
    from torch.distributed.pipelining.schedules import PipelineScheduleSingle
    from torch.distributed.pipelining.schedules import _PipelineSchedule as _PipelineSchedule  # every schedule's base
    from torchmetrics import Metric

# One computation of a schedule: (kind, stage, microbatch); an overlapped pair is listed as its two parts.
Computation = tuple[str, int, int]

_METADATA_HOOKS = ("_forward_metadata_inference", "_backward_metadata_inference")


def forward_only_schedule(stage: PipelineStage, n_microbatches: int) -> PipelineScheduleSingle:
    """A schedule running only forwards over one stage per rank."""
    return internal("torch.distributed.pipelining.schedules", "_ScheduleForwardOnly")(stage, n_microbatches)


# torch's computation types, by the letter this package writes for them (an overlapped forward and backward is
# listed as its two parts)
_KINDS = {"FORWARD": "F", "FULL_BACKWARD": "B", "BACKWARD_INPUT": "I", "BACKWARD_WEIGHT": "W"}


def schedule_actions(
    schedule: str, pp_size: int, microbatches: int, stages_per_rank: int
) -> list[list[Computation | list[Computation]]]:
    """Each pipeline rank's computations in the order torch's ``schedule`` runs them, as ``(kind, stage,
    microbatch)`` with kind ``F``, ``B`` (whole backward), ``I`` (input gradients) or ``W`` (weight gradients);
    an overlapped forward-backward (DualPipeV) becomes a list of its two parts. Communication and gradient
    reduction actions are left out."""
    ops = internal("torch.distributed.pipelining._schedule_visualizer", "get_schedule_ops")
    ranks = []
    for actions in ops(schedule, pp_size, microbatches, stages_per_rank):
        ours: list[Any] = []
        for action in actions:
            if action is None:
                continue
            parts = [_part(sub) for sub in action.sub_actions or ()] if action.sub_actions else [_part(action)]
            parts = [part for part in parts if part is not None]
            if parts:
                ours.append(parts if len(parts) > 1 else parts[0])
        ranks.append(ours)
    return ranks


def _part(action: Any) -> Computation | None:  # Any: torch's `_Action`, read as torch 2.13 builds it
    kind = _KINDS.get(getattr(action.computation_type, "name", ""))
    if kind is None:
        return None
    return kind, int(action.stage_index), int(action.microbatch_index)


def stage_class_with_shape_trial(trial: Callable[[nn.Module], AbstractContextManager[object]]) -> type[PipelineStage]:
    """A ``PipelineStage`` that runs torch's shape-inference trial inside ``trial(submodule)``.

    The trial runs the stage once on the first microbatch's inputs; the runtime must tell it from a real
    microbatch (it consumes none of the step's microbatches and logs nothing).
    """
    check()

    class StageWithShapeTrial(PipelineStage):
        @override
        def _forward_metadata_inference(self, *args: Any, **kwargs: Any) -> Any:
            with trial(self.submod):
                return super()._forward_metadata_inference(*args, **kwargs)

        @override
        def _backward_metadata_inference(self, *args: Any, **kwargs: Any) -> Any:
            with trial(self.submod):
                return super()._backward_metadata_inference(*args, **kwargs)

    return StageWithShapeTrial


_METRIC_ATTRIBUTES = ("_defaults", "_update_count", "_forward_cache", "_computed", "_to_sync", "_should_unsync")


def metric_states(metric: Metric) -> dict[str, list | torch.Tensor]:
    """The metric's state names and their defaults (``add_state``)."""
    return metric._defaults


def metric_progress(metric: Metric) -> tuple[int, object]:
    """``(update count, last forward value)``."""
    return metric._update_count, metric._forward_cache


# Any: torchmetrics declares `_forward_cache` as None (its initial value).
def set_metric_progress(metric: Any, update_count: int, forward_value: object) -> None:
    """Set the update count and forward value, dropping a cached ``compute()`` result."""
    metric._update_count, metric._forward_cache, metric._computed = update_count, forward_value, None


def set_metric_forward_value(metric: Any, forward_value: object) -> None:  # Any: as above
    metric._forward_cache = forward_value


def sync_as_in_forward(metric: Metric) -> None:
    """Make the next ``compute()`` sync as torchmetrics' own ``forward`` does: only with ``dist_sync_on_step``."""
    metric._to_sync, metric._should_unsync = metric.dist_sync_on_step, False


def forward_hook_functions(module: nn.Module) -> list[Callable[..., object]]:
    """The forward hooks registered on ``module`` (nothing public lists them)."""
    return list(module._forward_hooks.values())


def check() -> None:
    """Raise ``InternalChanged`` if an internal used here is gone: the runtime would otherwise misbehave silently."""
    internal("torch.distributed.pipelining.schedules", "_ScheduleForwardOnly")
    for name in _METADATA_HOOKS:
        if not callable(getattr(PipelineStage, name, None)):
            raise InternalChanged(changed(f"PipelineStage.{name}", "torch", "the method is gone"))
    from torchmetrics.aggregation import SumMetric

    metric = SumMetric()
    for name in _METRIC_ATTRIBUTES:
        if not hasattr(metric, name):
            raise InternalChanged(changed(f"torchmetrics.Metric.{name}", "torchmetrics", "the attribute is gone"))
