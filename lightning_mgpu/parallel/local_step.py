"""Optimizer steps on the local shards of DTensor parameters: the same arithmetic without DTensor's dispatch.

FSDP2 (ZeRO-2/3) and tensor parallelism leave parameters, gradients and optimizer states as DTensors, so a torch
optimizer pays DTensor's Python dispatch on every op of its update (on CPU, where torch's optimizers loop over
tensors one by one, that costs more than the arithmetic). The update of an elementwise optimizer (Adam, AdamW,
SGD, ...) at an element needs only that element's parameter, gradient and state: ``ShardLocalStep`` runs the
user's optimizer on the local tensors instead, handing each parameter's state over as its local tensors, and
wraps state the step created back into DTensors laid out like the parameter, so ``state_dict``, checkpoints and
clipping see exactly what the DTensor step leaves.

A step falls back to the DTensor path where the shortcut would be wrong: an optimizer class not known to be
elementwise (norm-based ones such as Adafactor, Muon or LAMB-like subclasses), or a gradient laid out unlike its
parameter (e.g. a ``Partial`` gradient that DTensor still has to reduce).

On plain CPU tensors, a torch optimizer left to choose its implementation (``foreach`` and ``fused`` unset) runs
its per-tensor Python loop; ``fused_on_cpu`` runs such a step with torch's fused CPU kernel instead (one call per
parameter group, the same arithmetic to rounding: ~5x less CPU for AdamW on the demo GPT's shards).
"""

from __future__ import annotations

import types
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer

# Exact classes whose update is elementwise in parameter, gradient and state (a subclass may change the math).
_ELEMENTWISE: frozenset[type] = frozenset(
    {
        torch.optim.Adam,
        torch.optim.AdamW,
        torch.optim.SGD,
        torch.optim.Adagrad,
        torch.optim.Adadelta,
        torch.optim.Adamax,
        torch.optim.NAdam,
        torch.optim.RAdam,
        torch.optim.RMSprop,
    }
)


# Exact classes whose fused CPU kernel (``fused=True``) computes what their default step computes (to rounding) and
# saves most: Adam's per-tensor loop runs a dozen ops per parameter.
_FUSED_ON_CPU: frozenset[type] = frozenset({torch.optim.Adam, torch.optim.AdamW})


@contextmanager
def fused_on_cpu(optimizer: Optimizer) -> Iterator[None]:
    """Within: the groups of plain CPU floating-point tensors whose ``foreach`` and ``fused`` the user left unset
    step with ``fused=True`` (restored after). Other groups, classes and devices step as they would."""
    chosen = []
    if type(optimizer) in _FUSED_ON_CPU:
        for group in optimizer.param_groups:
            if _fusable(group):
                group["fused"] = True
                chosen.append(group)
    try:
        yield
    finally:
        for group in chosen:
            group["fused"] = None


def _fusable(group: dict[str, Any]) -> bool:
    if group.get("fused", False) is not None or group.get("foreach", False) is not None:
        return False  # chosen by the user (or a class without the option)
    if group.get("differentiable") or group.get("capturable"):
        return False
    return all(
        type(p) in (torch.Tensor, torch.nn.Parameter)
        and p.device.type == "cpu"
        and p.is_floating_point()
        and (p.grad is None or p.grad.layout == torch.strided)
        for p in group["params"]
    )


def install_step(optimizer: Optimizer, step: Callable[..., object]) -> None:
    """Make ``step`` the optimizer's ``step``, as a method of the optimizer itself.

    An LR scheduler built after this (Lightning's ``lr_find``, ``StochasticWeightAveraging``'s ``SWALR``, one made in
    a hook) wraps ``optimizer.step.__func__`` and binds it to the optimizer again: the bound method of a wrapper
    object would then run with the optimizer as its ``self``.
    """

    def method(_optimizer: Optimizer, *args: object, **kwargs: object) -> Any:
        return step(*args, **kwargs)

    optimizer.step = types.MethodType(method, optimizer)  # type: ignore[method-assign]


def steps_on_shards(optimizer: Optimizer) -> bool:
    """Whether ``ShardLocalStep`` has work on ``optimizer``: its class is elementwise and it steps DTensors."""
    params = (p for group in optimizer.param_groups for p in group["params"])
    return type(optimizer) in _ELEMENTWISE and any(isinstance(p, DTensor) for p in params)


class ShardLocalStep:
    """Wraps ``optimizer.step`` (undone by ``remove``): the closure runs first, as torch's step would run it,
    then the update runs on the local tensors of the DTensor parameters."""

    def __init__(self, optimizer: Optimizer) -> None:
        self.optimizer = optimizer
        self._unwrapped_step: Callable[..., object] = optimizer.step
        self._own_step = vars(optimizer).get("step")  # an instance attribute already there (another wrapper)
        install_step(optimizer, self._step)

    def remove(self) -> None:
        if self._own_step is None:
            vars(self.optimizer).pop("step", None)
        else:
            self.optimizer.step = self._own_step  # type: ignore[method-assign]

    def _step(self, closure: Callable[[], object] | None = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        with torch.no_grad():  # to_local() then hands out the local tensors themselves
            self._step_locally()
        return loss

    def _step_locally(self) -> None:
        found = _local_parameters(self.optimizer)
        if found is None:
            self._unwrapped_step()
            return
        swapped, local_groups = found
        groups = self.optimizer.param_groups
        saved_params = [group["params"] for group in groups]
        state = self.optimizer.state
        befores = [state.pop(param, None) for param, _, _ in swapped]
        try:
            for (_, local, grad), before in zip(swapped, befores):
                local.grad = grad
                if before is not None:
                    state[local] = {key: _to_local(value) for key, value in before.items()}
            for group, params in zip(groups, local_groups):
                group["params"] = params
            with fused_on_cpu(self.optimizer):
                self._unwrapped_step()
        finally:
            for group, params in zip(groups, saved_params):
                group["params"] = params
            for (param, local, _), before in zip(swapped, befores):
                local.grad = None
                stepped = state.pop(local, None)
                if stepped is not None:
                    old = before or {}
                    before = {key: _as_dtensor_like(value, old.get(key), param) for key, value in stepped.items()}
                if before:
                    state[param] = before


_Swapped = list[tuple[DTensor, torch.Tensor, "torch.Tensor | None"]]


def _local_parameters(optimizer: Optimizer) -> tuple[_Swapped, list[list[torch.Tensor]]] | None:
    """``[(DTensor parameter, its local tensor, its gradient's local tensor)]`` and every group's parameters with the
    local tensors in their place; ``None`` if this step must run on the DTensors (no DTensor parameter, or a
    gradient not laid out like its parameter). Lists, not tensor-keyed dicts: ``Tensor.__hash__`` is Python."""
    swapped: _Swapped = []
    local_groups = []
    for group in optimizer.param_groups:
        params = []
        for param in group["params"]:
            if isinstance(param, DTensor):
                if param.dim() == 0:
                    return None  # its state would be 0-dim too, indistinguishable from a step count: DTensor's step
                grad = param.grad
                if grad is not None and not (
                    isinstance(grad, DTensor)
                    and grad.placements == param.placements
                    and grad.device_mesh == param.device_mesh
                ):
                    return None
                swapped.append((param, param.to_local(), None if grad is None else grad.to_local()))
                param = swapped[-1][1]
            params.append(param)
        local_groups.append(params)
    return (swapped, local_groups) if swapped else None


def _to_local(value: object) -> Any:
    return value.to_local() if isinstance(value, DTensor) else value


def _as_dtensor_like(value: object, before: Any, param: DTensor) -> Any:
    """A state value after the local step, as the DTensor step would have left it."""
    if isinstance(before, DTensor) and before.to_local() is value:
        return before  # updated in place through its local tensor
    if before is value:
        return value  # a plain value (a step count) updated in place
    if isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape == param.to_local().shape:
        return DTensor.from_local(
            value, param.device_mesh, param.placements, run_check=False, shape=param.shape, stride=param.stride()
        )
    return value
