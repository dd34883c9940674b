"""Whether DDP searches every step for parameters that got no gradient (``find_unused_parameters``).

The search is what lets a step leave parameters without a gradient (a head trained elsewhere, routed experts held
in a ``ModuleList``, layer drop), as FSDP2 allows, but it costs every step: a walk over the autograd graph after
forward and one more all-reduce (of the map of used parameters). Lightning's ``DDPStrategy`` leaves it off, so a
model with such parameters fails there.

``find_unused_parameters=None`` (the strategy's default) decides from the first step that synchronizes gradients:
DDP searches in it, and each of its backwards (one, or several under manual optimization: a GAN's generator and
discriminator losses) records which of the parameters that required a gradient when the step started got one. If
every backward on every rank gave every such parameter one, the reducer is rebuilt without the search (as
``DDPStrategy`` runs) when the next step starts; otherwise the search stays on (a discriminator that
``toggle_optimizer`` froze for the generator's backward keeps it on). From then on each synchronizing backward is
checked when it ends: one that left a parameter without a gradient stops the run there, before the optimizer steps on
gradients DDP did not reduce, with an error naming ``find_unused_parameters=True``. Models with a ``ModuleList`` of
routed experts start with the search on.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from lightning_mgpu._compat.fsdp import ddp_of, ddp_syncs_gradients, rebuild_ddp, reducer_finalized

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

_ATTRIBUTE = "_lightning_mgpu_unused_search"


class UnusedParameterSearch:
    """Watches a DDP root whose search is undecided (``find_unused_parameters=None``) or off (``False``).

    Its ``__call__`` is a forward pre-hook on the root, ahead of DDP's own; ``after_backward`` runs when a backward
    ends (``finish_backward``, from the strategy's ``backward``).
    """

    def __init__(
        self, root: nn.Module, group: ProcessGroup, ddp_kwargs: dict[str, Any], comm_hook: tuple[Any, Any] | None
    ):
        self.root = root
        self.group = group
        self.ddp_kwargs = ddp_kwargs
        self.comm_hook = comm_hook
        self.deciding: bool = ddp_kwargs["find_unused_parameters"]  # searching until the first synced step ended
        self.steps = 0  # steps that synchronize gradients so far
        self._wanted: list[nn.Parameter] = []  # what required a gradient when the deciding step started
        self._got_gradient: set[int] = set()
        self._all_used: bool | None = None  # whether every backward of the deciding step reached all of `_wanted`
        self._recording: list[Any] = []  # hooks recording which parameters got a gradient while deciding

    def __call__(self, module: nn.Module, args: Any) -> None:
        ddp = ddp_of(self.root)
        if ddp is not None and not ddp.find_unused_parameters and not reducer_finalized(ddp):
            raise RuntimeError(self._unused_message())  # a backward that never ran (training_step returned None)
        if not torch.is_grad_enabled():
            return  # evaluation
        if self._all_used is not None:
            self._decide()  # the deciding step's backwards all ran
        if ddp_syncs_gradients(self.root):
            self.steps += 1
            if self.deciding and not self._recording:
                self._wanted = [p for p in self.root.parameters() if p.requires_grad]
                self._got_gradient.clear()
                self._recording = [
                    p.register_post_accumulate_grad_hook(lambda p: self._got_gradient.add(id(p))) for p in self._wanted
                ]

    def after_backward(self) -> None:
        ddp = ddp_of(self.root)
        if ddp is None or not ddp_syncs_gradients(self.root):
            return  # a micro-step of gradient accumulation: DDP reduces nothing
        if self._recording:
            used = all(id(p) in self._got_gradient for p in self._wanted)
            self._all_used = used and self._all_used is not False
            self._got_gradient.clear()  # each backward must reach every parameter on its own
        elif not ddp.find_unused_parameters and not reducer_finalized(ddp):
            raise RuntimeError(self._unused_message())

    def remove(self) -> None:
        for hook in self._recording:
            hook.remove()
        self._recording = []

    def _decide(self) -> None:
        all_used = torch.tensor(int(bool(self._all_used)), device=self._wanted[0].device if self._wanted else None)
        dist.all_reduce(all_used, op=dist.ReduceOp.MIN, group=self.group)  # one decision for every rank
        self.remove()
        self.deciding, self._all_used, self._wanted = False, None, []
        if all_used.item():
            ddp = rebuild_ddp(self.root, **{**self.ddp_kwargs, "find_unused_parameters": False})
            if self.comm_hook is not None:
                ddp.register_comm_hook(*self.comm_hook)

    def _unused_message(self) -> str:
        why = (
            "find_unused_parameters=False"
            if not self.ddp_kwargs["find_unused_parameters"]
            else "every backward gave every parameter one in the first step, so the search stopped after it"
            " (find_unused_parameters=None, as Lightning's DDPStrategy runs)"
        )
        return (
            f"Step {self.steps} of this run left a parameter without a gradient on this rank (or its loss was not"
            f" backpropagated), and data parallelism (DDP, zero_stage 0/1) did not search for such parameters: {why}."
            " DDP did not reduce the gradients, so the run stops here. For a model whose steps can leave parameters"
            " unused (routed experts, layer drop, a loss term used on some steps, an optimizer's parameters frozen"
            " by `toggle_optimizer`), pass HybridStrategy(find_unused_parameters=True)."
        )


class TrainableWatch:
    """DDP reduces the gradients of the parameters that required one when its reducer was built: a parameter made
    trainable later (a backbone that ``BackboneFinetuning`` unfreezes) would train on each rank's own gradient, the
    ranks drifting apart (Lightning's ``DDPStrategy`` does so). A forward pre-hook on the root: when the set of
    parameters requiring a gradient differs from the reducer's at the start of a training forward, the reducer is
    rebuilt for the new set (its search setting and communication hook kept)."""

    def __init__(self, root: nn.Module, ddp_kwargs: dict[str, Any], comm_hook: tuple[Any, Any] | None) -> None:
        self.root = root
        self.ddp_kwargs = ddp_kwargs
        self.comm_hook = comm_hook
        self._built_for: tuple[int, ...] | None = None  # the trainable parameters of the reducer (by id)

    def __call__(self, module: nn.Module, args: Any) -> None:
        if not torch.is_grad_enabled():
            return
        trainable = tuple(id(p) for p in self.root.parameters() if p.requires_grad)
        ddp = ddp_of(self.root)
        if ddp is None or self._built_for is None:
            self._built_for = trainable  # DDP builds its reducer in this forward, for these parameters
            return
        if trainable == self._built_for:
            return
        ddp = rebuild_ddp(self.root, **{**self.ddp_kwargs, "find_unused_parameters": ddp.find_unused_parameters})
        if self.comm_hook is not None:
            ddp.register_comm_hook(*self.comm_hook)
        self._built_for = trainable


def watch_unused_parameters(
    root: nn.Module, group: ProcessGroup, ddp_kwargs: dict[str, Any], comm_hook: tuple[Any, Any] | None
) -> None:
    """Attach an ``UnusedParameterSearch`` to a DDP root built with ``ddp_kwargs`` (undone with the root's hooks
    and attributes when the strategy restores the module)."""
    search = UnusedParameterSearch(root, group, ddp_kwargs, comm_hook)
    root.register_forward_pre_hook(search, prepend=True)
    setattr(root, _ATTRIBUTE, search)


def watch_trainable(root: nn.Module, ddp_kwargs: dict[str, Any], comm_hook: tuple[Any, Any] | None) -> None:
    """Attach a ``TrainableWatch`` to a DDP root built with ``ddp_kwargs`` (undone with the root's hooks)."""
    root.register_forward_pre_hook(TrainableWatch(root, ddp_kwargs, comm_hook), prepend=True)


def stop_watching(root: nn.Module) -> None:
    """Remove the recording hooks from the user's parameters (a run that ended before its first synced backward)."""
    search = getattr(root, _ATTRIBUTE, None)
    if search is not None:
        search.remove()


def finish_backward(roots: list[nn.Module]) -> None:
    """After a backward: decide the search, or refuse a step that left a parameter without a gradient."""
    for root in roots:
        search = getattr(root, _ATTRIBUTE, None)
        if search is not None:
            search.after_backward()
