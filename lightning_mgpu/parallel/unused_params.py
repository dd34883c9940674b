"""Whether DDP searches every step for parameters that got no gradient (``find_unused_parameters``).

The search is what lets a step leave parameters without a gradient (a head trained elsewhere, routed experts held
in a ``ModuleList``, layer drop), as FSDP2 allows, but it costs every step: a walk over the autograd graph after
forward and one more all-reduce (of the map of used parameters). Lightning's ``DDPStrategy`` leaves it off, so a
model with such parameters fails there.

``find_unused_parameters=None`` (the strategy's default) decides from the first step: DDP searches in it, and if
every rank gave every parameter a gradient, the reducer is rebuilt without the search, as ``DDPStrategy`` runs.
Otherwise the search stays on. A later step that leaves a parameter without a gradient then stops the run with an
error naming ``find_unused_parameters=True``, before the next forward (the reducer did not finish that step).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from lightning_mgpu._compat.fsdp import ddp_of, ddp_syncs_gradients, ranks_that_used, rebuild_ddp, reducer_finalized


class UnusedParameterSearch:
    """Forward pre-hook on a DDP root, ahead of DDP's own: with ``searching=None``, after the first step that
    synchronized gradients, turns the search off if it found nothing; while the search is off, refuses to go on after
    a step that left a parameter without a gradient (DDP's own error names its constructor, not the strategy)."""

    def __init__(self, root: nn.Module, world: int, ddp_kwargs: dict[str, Any], comm_hook: tuple[Any, Any] | None):
        self.root = root
        self.world = world
        self.ddp_kwargs = ddp_kwargs
        self.comm_hook = comm_hook
        self.deciding = ddp_kwargs["find_unused_parameters"]  # True while the first step decides
        self.synced_steps = 0

    def __call__(self, module: nn.Module, args: Any) -> None:
        ddp = ddp_of(self.root)
        if ddp is not None and self.synced_steps:
            if self.deciding:
                self.deciding = False
                if reducer_finalized(ddp) and bool((ranks_that_used(ddp) == self.world).all()):
                    self._rebuild_without_search()
            elif not ddp.find_unused_parameters and not reducer_finalized(ddp):
                raise RuntimeError(_UNUSED_LATER.format(step=self.synced_steps))
        if torch.is_grad_enabled() and ddp_syncs_gradients(self.root):
            self.synced_steps += 1

    def _rebuild_without_search(self) -> None:
        ddp = rebuild_ddp(self.root, **{**self.ddp_kwargs, "find_unused_parameters": False})
        if self.comm_hook is not None:
            ddp.register_comm_hook(*self.comm_hook)


_UNUSED_LATER = (
    "Step {step} left a parameter without a gradient (or its loss was not backpropagated) while data parallelism"
    " (DDP, zero_stage 0/1) did not search for unused parameters: with find_unused_parameters=None it stops"
    " searching when every parameter had a gradient in the first step, as Lightning's DDPStrategy runs. For a model"
    " whose steps can leave parameters unused (routed experts in a ModuleList, layer drop, a head used on some"
    " steps), pass HybridStrategy(find_unused_parameters=True)."
)
