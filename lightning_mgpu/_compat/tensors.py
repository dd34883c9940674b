"""Tensor and module internals (checked on torch 2.13.0).

- ``tree_map``/``tree_leaves``/``tree_flatten``: ``torch.utils._pytree``. torch has no public pytree module yet;
  this one knows torch's own containers (``torch.return_types``, ``ModelOutput`` registrations), which
  ``optree`` or a hand-written walk would not.
- ``TorchDispatchMode``: ``torch.utils._python_dispatch``; the only way to see every op (for measuring memory).
- ``FakeTensorMode``: ``torch._subclasses.fake_tensor``; shapes through a forward without memory or compute
  (``torch.device("meta")`` fails on ops with data-dependent output shapes, fake tensors do not).
- ``version_counter``: ``Tensor._version``, the in-place modification counter; no public accessor.
- ``has_post_accumulate_grad_hook``: ``Tensor._post_accumulate_grad_hooks``; ``register_post_accumulate_grad_hook``
  returns a handle but nothing public lists the hooks a tensor already has.
- ``has_backward_hook``: ``Tensor._backward_hooks``; ``register_hook`` returns a handle but nothing public lists
  the hooks a tensor already has (a module's ``.to()`` and FSDP2's unsharded parameters are new tensors without).
- ``view_base``: ``Tensor._base``, the tensor a view was made from; no public accessor.
- ``swap_parameters``/``restore_parameters``/``set_children``: ``nn.Module._parameters``/``_modules``. Assigning
  a plain tensor over a registered parameter through ``setattr`` raises, and ``del`` + ``register_parameter``
  reorders the parameters (their order is the optimizer's and the checkpoint's); the dicts keep the order.
- ``HOOK_ATTRIBUTES``/``module_hooks``/``set_module_hooks``: ``nn.Module``'s hook dictionaries (``_forward_hooks``,
  ``_backward_pre_hooks``, ..., found as the ``*hook*`` entries of a fresh module's ``__dict__``). Torch's
  composable APIs register hooks without handing back handles, and nothing public lists or removes them.
- ``module_structure``/``set_module_structure``: ``nn.Module._modules``/``_parameters``/``_buffers`` as a whole,
  to put a module tree back as it was after a run changed it in place (``register_module``/``register_parameter``
  keep existing entries and append new ones, so they cannot restore names, ``None`` slots and order).
- ``persistent_buffer_names``: ``nn.Module._non_persistent_buffers_set``; only ``state_dict`` tells persistent
  buffers apart, and calling it runs the state-dict hooks of whatever wraps the module (FSDP2's).
- ``module_twin``: ``nn.Module._modules``/``_parameters``/``_buffers`` given fresh dicts on a shallow copy: the
  module's own attributes and code with other tensors in its slots and no children, for running its initializer on
  full-size copies of a sharded module's tensors. A shallow copy shares the slot dicts; ``copy.deepcopy`` would copy
  the children (a whole model).
- ``plain_parameter_slots``: ``nn.Module._parameters`` replaced by a ``dict`` subclass (DeepSpeed ZeRO-3 puts one
  that gathers on access), made a plain ``dict`` again with the same entries, read without the subclass's hooks;
  ``named_parameters``/``_parameters[...]`` would trigger them, and nothing public replaces the slot dict.
- ``share_parameter_slots``: ``nn.Module._parameters``, one dict shared by two modules, so that what a wrap puts in
  one module's slots (FSDP2's sharded or gathered parameters) is what the other's code reads; nothing public shares
  registrations.
- ``contiguous_grad``: a ``torch.autograd.Function``, whose metaclass sets the private ``_backward_cls``.
- ``in_backward``: ``torch._C._current_graph_task_id`` (-1 outside autograd's engine); no public API tells a
  forward recomputed by activation checkpointing in backward from a first forward (expert token counts).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import nn

from lightning_mgpu._compat import changed, internal

if TYPE_CHECKING:
    from torch._ops import (
        OpOverload as OpOverload,  # an operator's overload (torch.ops.aten.mm.default): no public name
    )
    from torch._subclasses.fake_tensor import FakeTensorMode

tree_map = internal("torch.utils._pytree", "tree_map")
tree_leaves = internal("torch.utils._pytree", "tree_leaves")
tree_flatten = internal("torch.utils._pytree", "tree_flatten")
TorchDispatchMode: type = internal("torch.utils._python_dispatch", "TorchDispatchMode")


def fake_tensor_mode(**kwargs: object) -> FakeTensorMode:
    """A ``FakeTensorMode`` (imported on use: it pulls in much of torch's compiler stack)."""
    return internal("torch._subclasses.fake_tensor", "FakeTensorMode")(**kwargs)


def version_counter(tensor: torch.Tensor) -> int:
    """How many times ``tensor`` was modified in place (not defined for inference tensors)."""
    return tensor._version


def has_post_accumulate_grad_hook(param: torch.Tensor) -> bool:
    hooks = getattr(param, "_post_accumulate_grad_hooks", changed)
    if hooks is changed:
        raise AttributeError(changed("Tensor._post_accumulate_grad_hooks", "torch", "the attribute is gone"))
    return bool(hooks)


def has_backward_hook(tensor: torch.Tensor, hook: object) -> bool:
    """Whether ``hook`` (compared with ``==``, so a bound method matches) is registered on ``tensor``."""
    hooks: object = getattr(tensor, "_backward_hooks", changed)
    if hooks is changed:
        raise AttributeError(changed("Tensor._backward_hooks", "torch", "the attribute is gone"))
    return hook in (cast("dict[int, object] | None", hooks) or {}).values()  # the hooks by handle id


def view_base(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor ``tensor`` is a view of, or ``tensor`` itself if it is none."""
    return tensor._base if tensor._base is not None else tensor


def _slots(module: nn.Module, name: str) -> dict[str, Any]:
    slots = module.__dict__.get(name)
    if not isinstance(slots, dict):
        raise AttributeError(changed(f"nn.Module.{name}", "torch", "no longer a dict in the module's __dict__"))
    return slots


def swap_parameters(module: nn.Module, tensors: dict[str, torch.Tensor]) -> dict[str, Any]:
    """Put ``tensors`` (e.g. local views of DTensor parameters) in the module's own parameter slots for a call;
    returns the parameters they replaced, for :func:`restore_parameters`."""
    slots = _slots(module, "_parameters")
    originals = {name: slots[name] for name in tensors}
    slots.update(tensors)
    return originals


def restore_parameters(module: nn.Module, originals: Mapping[str, torch.Tensor | None]) -> None:
    _slots(module, "_parameters").update(originals)


def parameter_slots(module: nn.Module) -> dict[str, torch.Tensor | None]:
    """The module's own registered parameters by name, including slots that hold ``None``."""
    return dict(_slots(module, "_parameters"))


def share_parameter_slots(module: nn.Module, source: nn.Module) -> None:
    """Make ``module`` hold exactly ``source``'s own parameters, through the same slot dict (see the docstring)."""
    module.__dict__["_parameters"] = _slots(source, "_parameters")


class _ContiguousGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx: object, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: object, grad: torch.Tensor) -> torch.Tensor:
        return grad.contiguous()


def contiguous_grad(x: torch.Tensor) -> torch.Tensor:
    """``x`` (a view), whose gradient leaves backward contiguous: the gradient of a pipeline stage's input is sent
    over the wire, and a model that permutes its activations (ConvNeXt's channels-last blocks) makes it strided."""
    return _ContiguousGrad.apply(x)


def set_children(module: nn.Module, children: Mapping[str, nn.Module]) -> None:
    """Make ``children`` the module's only submodules, in this order (an ``nn.ModuleList`` keeps its own names)."""
    slots = _slots(module, "_modules")
    slots.clear()
    slots.update(children)


HOOK_ATTRIBUTES: tuple[str, ...] = tuple(name for name in vars(nn.Module()) if "hook" in name)


def module_hooks(module: nn.Module) -> dict[str, object]:
    """Copies of every hook dictionary (and set, and flag) ``module`` keeps, by attribute name."""
    return {name: _copy(getattr(module, name)) for name in HOOK_ATTRIBUTES}


def set_module_hooks(module: nn.Module, saved: Mapping[str, object]) -> None:
    """Make ``module``'s hooks what :func:`module_hooks` returned; dictionaries and sets are refilled in place, so
    the handles of hooks registered before stay valid."""
    for name, value in saved.items():
        current = getattr(module, name)
        if isinstance(value, (dict, set)):
            current.clear()
            current.update(value)
        else:
            setattr(module, name, value)


def module_structure(module: nn.Module) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """Copies of the module's own (children, parameters, buffers) slots, in order, ``None`` slots included."""
    return (dict(_slots(module, "_modules")), dict(_slots(module, "_parameters")), dict(_slots(module, "_buffers")))


def set_module_structure(
    module: nn.Module,
    children: Mapping[str, nn.Module | None],
    parameters: Mapping[str, torch.Tensor | None],
    buffers: Mapping[str, torch.Tensor | None],
) -> None:
    """Make the module's own children, parameters and buffers exactly these (what :func:`module_structure` returned)."""
    for name, saved in (("_modules", children), ("_parameters", parameters), ("_buffers", buffers)):
        slots = _slots(module, name)
        slots.clear()
        slots.update(saved)


def persistent_buffer_names(module: nn.Module) -> list[str]:
    """The names (under ``module``) of the buffers its ``state_dict`` holds: those not registered with
    ``persistent=False``."""
    names = []
    for prefix, sub in module.named_modules():
        skipped = getattr(sub, "_non_persistent_buffers_set", None)
        if skipped is None:
            raise AttributeError(changed("nn.Module._non_persistent_buffers_set", "torch", "the attribute is gone"))
        names += [
            f"{prefix}.{name}" if prefix else name
            for name, b in _slots(sub, "_buffers").items()
            if b is not None and name not in skipped
        ]
    return names


def module_twin(
    module: nn.Module, parameters: Mapping[str, nn.Parameter | None], buffers: Mapping[str, torch.Tensor | None]
) -> nn.Module:
    """A shallow copy of ``module`` holding ``parameters`` and ``buffers`` as its own and no children."""
    import copy

    twin = copy.copy(module)
    for name, slots in (("_modules", {}), ("_parameters", dict(parameters)), ("_buffers", dict(buffers))):
        twin.__dict__[name] = slots
    return twin


def plain_parameter_slots(module: nn.Module) -> None:
    """Make the module's parameter slots a plain ``dict`` again if something replaced them by a subclass."""
    slots = _slots(module, "_parameters")
    if type(slots) is not dict:
        module.__dict__["_parameters"] = dict(dict.items(slots))


def _copy(value: object) -> object:
    return type(value)(value) if isinstance(value, (dict, set)) else value


def in_backward() -> bool:
    """Whether autograd's engine runs a backward on this thread (where activation checkpointing recomputes
    forwards): ``torch._C._current_graph_task_id``; no public API says so."""
    task = getattr(torch._C, "_current_graph_task_id", None)
    if task is None:
        raise AttributeError(changed("torch._C._current_graph_task_id", "torch", "the function is gone"))
    return task() != -1
