"""Giving the user's module and optimizer back from a DeepSpeed engine as plain torch objects.

``deepspeed.initialize`` changes the objects it is given in place: every parameter's ``data`` becomes a view into
a flat low-precision buffer (ZeRO-1/2) or an empty placeholder beside its partition (ZeRO-3), parameters and
modules get DeepSpeed attributes (``ds_id``, ``ds_tensor``, ``_hp_mapping``, ``all_gather``, ...), ZeRO-3 swaps
each module's ``_parameters`` for a dict that gathers on access and registers hooks, and the optimizer's param
groups hold DeepSpeed's flat fp32 partitions instead of the parameters. ``engine.destroy()`` removes DeepSpeed's
hooks only. :class:`DeepSpeedRelease` records what it needs before the engine is built and undoes the rest:
each parameter gets its whole trained fp32 value (cast back to its dtype before the fit), the attributes
DeepSpeed added are removed, ``_parameters`` is a plain dict again, and the optimizer's groups hold the
parameters again with their whole per-parameter states. Collective (values are gathered over the group).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.optim import Optimizer

from lightning_mgpu._compat.tensors import plain_parameter_slots
from lightning_mgpu.checkpoint.format import STATE_PREFIX

if TYPE_CHECKING:
    from lightning_mgpu.backends.deepspeed.states import EngineRunner

# Attributes DeepSpeed puts on modules (deepspeed 0.19: runtime/zero/parameter_offload.py, partition_parameters.py);
# modules also carry Lightning's and the user's own attributes, so only these go.
_MODULE_ATTRIBUTES = frozenset(
    {
        "_external_params",
        "_original_parameters",
        "pre_bwd_fn",
        "post_bwd_fn",
        "applied_pre_backward_ref_cnt",
        "all_parameters",
        "wall_clock_breakdown",
    }
)


class DeepSpeedRelease:
    """What the module and optimizer looked like before ``deepspeed.initialize``; :meth:`release` restores it."""

    def __init__(self, root: nn.Module, optimizer: Optimizer | None) -> None:
        self.module_keys = {id(m): frozenset(vars(m)) for m in root.modules()}
        self.params = {id(p): (frozenset(vars(p)), p.dtype) for p in root.parameters()}
        self.buffers = {id(b): b.dtype for b in root.buffers()}
        self.groups = [list(group["params"]) for group in optimizer.param_groups] if optimizer else []
        self._own_zero_grad: tuple[bool, Any] = (False, None)  # the optimizer's instance `zero_grad` before routing

    def route_zero_grad(self, optimizer: Optimizer, zero: Any) -> None:
        """Lightning zeroes gradients through the user's optimizer, whose groups DeepSpeed pointed at its flat fp32
        partitions: ``zero_grad(set_to_none=True)`` there drops the gradient buffers DeepSpeed keeps on them (ZeRO-1/2
        with ``offload_optimizer``: the next backward fails). Route it to DeepSpeed's optimizer (``zero``), which
        zeroes the module's gradients, as under Lightning's DeepSpeedStrategy; :meth:`release` undoes it."""
        self._own_zero_grad = ("zero_grad" in vars(optimizer), vars(optimizer).get("zero_grad"))
        optimizer.zero_grad = zero.zero_grad  # type: ignore[method-assign]

    def release(self, runner: EngineRunner, module: nn.Module) -> None:
        """Gather the trained values, destroy the engine, and put the plain module and optimizer back."""
        from lightning_mgpu.backends.deepspeed.states import DeepSpeedStates

        access = DeepSpeedStates(runner)
        values = access.full_model_state(module)
        optimizer = runner.optimizer
        flat = access.full_optimizer_state(module, optimizer) if optimizer is not None else {}
        names = {param: name for name, param in reversed(list(module.named_parameters(remove_duplicate=False)))}
        assert runner.engine is not None
        runner.engine.destroy()
        with torch.no_grad():
            for sub in module.modules():
                self._release_module(sub)
            for name, param in module.named_parameters(remove_duplicate=False):
                self._release_param(param, values[name])
            for buffer in module.buffers():
                buffer.data = buffer.data.to(self.buffers.get(id(buffer), buffer.dtype))
        if optimizer is not None:
            self._release_optimizer(optimizer, flat, names)

    def _release_module(self, sub: nn.Module) -> None:
        plain_parameter_slots(sub)  # ZeRO-3's gathering dict; read without triggering a gather
        before = self.module_keys.get(id(sub), frozenset())
        for key in set(vars(sub)) - before:
            if key.startswith("ds_") or key in _MODULE_ATTRIBUTES:
                delattr(sub, key)

    def _release_param(self, param: nn.Parameter, value: torch.Tensor) -> None:
        keys, dtype = self.params.get(id(param), (frozenset(vars(param)), param.dtype))
        for key in set(vars(param)) - keys:  # everything DeepSpeed added (nothing else adds to a parameter)
            delattr(param, key)
        param.data = value.detach().to(dtype).clone()
        param.grad = None

    def _release_optimizer(self, optimizer: Optimizer, flat: dict[str, Any], names: dict[nn.Parameter, str]) -> None:
        had_own, own = self._own_zero_grad
        if had_own:
            optimizer.zero_grad = own  # type: ignore[method-assign]
        else:
            vars(optimizer).pop("zero_grad", None)
        optimizer.state.clear()
        for group, params in zip(optimizer.param_groups, self.groups):
            group["params"] = params
            for param in params:
                prefix = f"{STATE_PREFIX}{names[param]}."
                state = {key[len(prefix) :]: value for key, value in flat.items() if key.startswith(prefix)}
                if state:
                    optimizer.state[param] = {
                        key: value.to(param.dtype) if torch.is_tensor(value) and value.dim() > 0 else value
                        for key, value in state.items()
                    }
