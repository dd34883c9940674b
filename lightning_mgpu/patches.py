"""Undoing what a run did to the user's objects: one record per ``fit``, undone in the strategy's ``teardown``.

Two kinds of change are made to user objects while they train, and both are recorded here:

- ``PatchLog``: changes made by our own code to objects that are not modules' structure: an optimizer's
  ``zero_grad``, a metric's ``process_group``, hooks we hold handles for. Every code path that patches a user
  object registers the undo here (``set_attribute``, ``keep_attribute``, ``hook``, ``add``); ``undo()`` runs them
  last-first.
- ``ModuleSnapshot``: the module tree as it was before it was parallelized. Torch's own APIs (``fully_shard``,
  ``parallelize_module``, ``distribute_module``) change classes, register hooks and replace parameters by
  DTensors without handing back handles, and the pipeline split replaces modules by stand-ins; the snapshot puts
  back each module's class, hooks, children, parameters and buffers (the same objects: tied weights and
  references the user holds stay valid), its instance ``forward`` and removes the attributes torch and we add
  (``_lightning_mgpu*``/``_mgpu*`` are ours). ``restore(state)`` then gives the original parameters the trained
  values.

While the run trains, originals no longer used by the parallel module are emptied (``release``), so keeping them
costs no memory.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from lightning_mgpu._compat.fsdp import forget_composable_state, is_torch_added_attribute
from lightning_mgpu._compat.tensors import module_hooks, module_structure, set_module_hooks, set_module_structure

_ABSENT = object()
# The attributes our own code puts on modules start with these.
_OUR_PREFIXES = ("_lightning_mgpu", "_mgpu")


def _added_by_the_run(name: str) -> bool:
    return name.startswith(_OUR_PREFIXES) or is_torch_added_attribute(name) or name == "forward"


class PatchLog:
    """The undo of every patch made on a user object during one run, undone last-first by ``undo()``."""

    def __init__(self) -> None:
        self._undo: list[Callable[[], None]] = []
        self._process_wide: list[Callable[[], None]] = []  # patches of torch itself, not of the user's objects

    def add(self, undo: Callable[[], None]) -> None:
        """Register any undo (e.g. a helper's ``remove``)."""
        self._undo.append(undo)

    def hook(self, handle: Any) -> Any:
        """Register a ``RemovableHandle`` (or anything with ``remove()``); returns it."""
        self._undo.append(handle.remove)
        return handle

    def keep_attribute(self, obj: object, name: str) -> None:
        """Record ``obj.name`` as it is now (an instance attribute, or none), to be put back by ``undo()``."""
        before = vars(obj).get(name, _ABSENT)

        def undo() -> None:
            if before is _ABSENT:
                vars(obj).pop(name, None)
            else:
                setattr(obj, name, before)

        self._undo.append(undo)

    def set_attribute(self, obj: object, name: str, value: object) -> None:
        """``setattr(obj, name, value)``, undone by ``undo()``."""
        self.keep_attribute(obj, name)
        setattr(obj, name, value)

    def set_process_wide(self, obj: object, name: str, value: object) -> None:
        """``setattr`` on torch itself (``torch.nn.functional``): undone by ``undo()`` and also by
        ``undo_process_wide()``, when a run ends leaving the user's module parallelized, so that no other code in
        the process calls into a finished run."""
        before = getattr(obj, name)
        setattr(obj, name, value)
        self._process_wide.append(lambda: setattr(obj, name, before))

    def add_process_wide(self, undo: Callable[[], None]) -> None:
        """Register the undo of a patch of torch itself (see ``set_process_wide``)."""
        self._process_wide.append(undo)

    def undo_process_wide(self) -> None:
        while self._process_wide:
            self._process_wide.pop()()

    def undo(self) -> None:
        self.undo_process_wide()
        while self._undo:
            self._undo.pop()()


@dataclass
class _ModuleState:
    """What one module looked like before the run: its class and the contents of its structural dictionaries."""

    names: list[str]  # every FQN it has (a module can be shared)
    cls: type
    hooks: dict[str, Any]
    modules: dict[str, nn.Module | None]
    parameters: dict[str, nn.Parameter | None]
    buffers: dict[str, Tensor | None]
    forward: Any
    keys: frozenset[str]


@dataclass
class _ParamState:
    requires_grad: bool
    device: torch.device


@dataclass
class ModuleSnapshot:
    """The tree under ``module`` before it was parallelized; ``restore`` brings it back with the trained values."""

    module: nn.Module
    states: dict[int, tuple[nn.Module, _ModuleState]] = field(default_factory=dict)
    params: dict[int, tuple[nn.Parameter, _ParamState]] = field(default_factory=dict)
    released: set[int] = field(default_factory=set)

    @classmethod
    def take(cls, module: nn.Module) -> ModuleSnapshot:
        snapshot = cls(module)
        for name, sub in module.named_modules(remove_duplicate=False):
            if id(sub) in snapshot.states:
                snapshot.states[id(sub)][1].names.append(name)
                continue
            modules, parameters, buffers = module_structure(sub)
            state = _ModuleState(
                names=[name],
                cls=type(sub),
                hooks=module_hooks(sub),
                modules=modules,
                parameters=parameters,
                buffers=buffers,
                forward=vars(sub).get("forward", _ABSENT),
                keys=frozenset(vars(sub)),
            )
            snapshot.states[id(sub)] = (sub, state)
            for param in parameters.values():
                if param is not None:
                    snapshot.params[id(param)] = (param, _ParamState(param.requires_grad, param.device))
        return snapshot

    def release(self) -> None:
        """Empty the original parameters the parallel module no longer holds (they come back in ``restore``)."""
        live = {id(p) for p in self.module.parameters()}
        for key, (param, _) in self.params.items():
            if key not in live and key not in self.released:
                param.data = param.data.new_empty(0)  # `set_data` keeps the device type: no meta
                self.released.add(key)

    def restore_structure(self) -> None:
        """Classes, hooks, children, parameters, buffers, ``forward`` and attributes as they were; no values."""
        for sub, state in self.states.values():
            if type(sub) is not state.cls:
                sub.__class__ = state.cls
            forget_composable_state(sub)  # torch refuses a second fully_shard/replicate otherwise
            set_module_hooks(sub, state.hooks)  # in place: handles of hooks registered before stay valid
            set_module_structure(sub, state.modules, state.parameters, state.buffers)
            for key in set(vars(sub)) - state.keys:
                if _added_by_the_run(key):
                    del vars(sub)[key]
            if state.forward is not _ABSENT:
                vars(sub)["forward"] = state.forward

    def restore(self, state_dict: dict[str, Tensor]) -> None:
        """Restore the structure, then give every original parameter and buffer its value in ``state_dict``.

        ``state_dict`` holds the full (unsharded) trained values under the names ``named_parameters`` and
        ``named_buffers`` give them (``checkpoint.states.full_named_tensors``); a parameter emptied by ``release``
        that it lacks is an error.
        """
        self.restore_structure()
        for sub, state in self.states.values():
            for is_parameter, values in ((True, state.parameters), (False, state.buffers)):
                for name, tensor in values.items():
                    if tensor is None:
                        continue
                    value = next(
                        (
                            state_dict[f"{p}.{name}" if p else name]
                            for p in state.names
                            if (f"{p}.{name}" if p else name) in state_dict
                        ),
                        None,
                    )
                    self._assign(sub, is_parameter, name, tensor, value)
        self.released.clear()

    def _assign(self, sub: nn.Module, is_parameter: bool, name: str, tensor: Tensor, value: Tensor | None) -> None:
        param = self.params.get(id(tensor)) if is_parameter else None
        if value is None:
            if param is not None and id(tensor) in self.released:
                raise RuntimeError(
                    f"lightning-mgpu could not restore {type(sub).__name__}.{name}: the gathered state has no value"
                    " for it. Please report this."
                )
            return
        device = param[1].device if param is not None else tensor.device
        with torch.no_grad():
            tensor.data = value.detach().to(device=device, dtype=tensor.dtype)
        if param is not None:
            tensor.requires_grad_(param[1].requires_grad)
            tensor.grad = None
