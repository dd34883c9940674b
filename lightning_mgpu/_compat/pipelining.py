"""The private parts of ``torch.distributed.pipelining`` (and ``torch.utils._pytree``) the pipeline runtime uses.

Checked on torch 2.13. Each shim names the public API it stands in for; ``check()`` (run by
``tests/parallel/test_pipeline_compat.py``) fails loudly when torch renames or drops one of them.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import torch.utils._pytree as _pytree
from torch import nn
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining import schedules as _schedules

# Public stand-in: none (torch's own pytree, used by every torch.distributed module). ``tree_map(fn, tree)`` maps the
# leaves of nested tuples/lists/dicts; ``tree_leaves(tree)`` lists them.
tree_map = _pytree.tree_map
tree_leaves = _pytree.tree_leaves

_METADATA_HOOKS = ("_forward_metadata_inference", "_backward_metadata_inference")


def forward_only_schedule(stage: PipelineStage, n_microbatches: int) -> Any:
    """A schedule running only forwards over one stage per rank (``_ScheduleForwardOnly``).

    Public stand-in: ``Schedule1F1B``/``ScheduleGPipe.eval``, which also run forward only but need a loss function
    on the last stage.
    """
    return _schedules._ScheduleForwardOnly(stage, n_microbatches)


def stage_class_with_shape_trial(trial: Callable[[nn.Module], AbstractContextManager[Any]]) -> type[PipelineStage]:
    """A ``PipelineStage`` that runs its shape-inference trial forward/backward inside ``trial(submodule)``.

    torch infers the shapes a stage sends on its first step by running the stage once on the first microbatch's
    inputs (``_forward_metadata_inference``; ``_backward_metadata_inference`` for gradients). The pipeline runtime
    must tell that trial from a real microbatch (it consumes none of the step's microbatches and logs nothing).
    Public stand-in: ``PipelineStage(input_args=..., output_args=...)`` with static shapes, which the runtime cannot
    give because shapes come from the user's batches.
    """

    class StageWithShapeTrial(PipelineStage):
        def _forward_metadata_inference(self, *args: Any, **kwargs: Any) -> Any:
            with trial(self.submod):
                return super()._forward_metadata_inference(*args, **kwargs)

        def _backward_metadata_inference(self, *args: Any, **kwargs: Any) -> Any:
            with trial(self.submod):
                return super()._backward_metadata_inference(*args, **kwargs)

    return StageWithShapeTrial


def check() -> None:
    """Raise if an internal used here is gone (a torch upgrade): the runtime would otherwise misbehave silently."""
    missing = [name for name in _METADATA_HOOKS if not callable(getattr(PipelineStage, name, None))]
    if not hasattr(_schedules, "_ScheduleForwardOnly"):
        missing.append("schedules._ScheduleForwardOnly")
    if not callable(getattr(_pytree, "tree_map", None)) or not callable(getattr(_pytree, "tree_leaves", None)):
        missing.append("torch.utils._pytree.tree_map/tree_leaves")
    if missing:
        raise ImportError(
            f"lightning-mgpu's pipeline runtime needs torch.distributed.pipelining internals that this torch lacks:"
            f" {missing}. It was checked on torch 2.13; update lightning_mgpu/_compat/pipelining.py."
        )
