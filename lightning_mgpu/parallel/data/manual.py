"""Manual optimization under data parallelism: ``manual_backward`` runs inside ``training_step``, which is the
data-parallel root's forward.

DDP and FSDP2 get ready to reduce gradients when a forward returns: DDP's reducer expects the backward of that
forward's output; FSDP2 hooks the output, and the backward it starts reduces the gradients when it ends. Inside the
root's forward neither has happened, so:

- DDP (ZeRO 0/1 on plain parameters): the reducer is readied for each ``manual_backward``'s loss before it runs
  (``prepare_backward``), as Lightning's ``DDPStrategy.pre_backward`` does, and not for the step's output when the
  forward returns (``reduce_in_step_only``, as Lightning's ``_DDPForwardRedirection``). Parameters a backward does
  not reach (a discriminator that ``toggle_optimizer`` froze for the generator's step) are found by the search that
  ``find_unused_parameters=None`` starts with (``unused_params.py``), which then stays on.
- FSDP2 (ZeRO 2/3, and ZeRO 0/1 through FSDP2's replicate): the root would gather its own parameters once, when the
  step starts, and reduce their gradients after no backward at all. Each submodule the step calls (the generator,
  the discriminator) is made a unit of its own (``called_units``): its forward gathers its parameters, with the
  ``requires_grad`` that ``toggle_optimizer`` just set and the values the last ``optimizer.step()`` wrote, and the
  backward of its output reduces their gradients. The root then holds no parameter.
"""

from __future__ import annotations

import dataclasses
import types
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from lightning_mgpu._compat.fsdp import (
    follow_into_backward,
    is_ddp_replicated,
    prepare_ddp_backward,
    skip_ddp_post_forward_reduction,
)

# Containers a step indexes into rather than calls: their children are the units.
_CONTAINERS = (nn.ModuleList, nn.ModuleDict)


def called_units(module: nn.Module, units: Iterable[Any], zero_stage: int) -> list[nn.Module | list[nn.Module]]:
    """The submodules of ``module`` that hold the parameters no unit in ``units`` (modules or lists of modules)
    holds: its children, or a container's children; children that share a parameter (a tied embedding and head)
    form one unit, a list. Refused when a parameter lies outside every submodule a step can call (on the
    LightningModule itself, or in a ``ParameterList``)."""
    parts = [part for unit in units for part in (unit if isinstance(unit, list) else [unit])]
    taken = {id(p) for part in parts for p in part.parameters()}
    found: list[list[nn.Module]] = []
    owner: dict[int, list[nn.Module]] = {}  # parameter -> the found unit holding it

    def visit(parent: nn.Module) -> None:
        for child in parent.children():
            shared = next((owner[id(p)] for p in child.parameters() if id(p) in owner), None)
            if shared is None and all(id(p) in taken for p in child.parameters()):
                continue
            if isinstance(child, _CONTAINERS):
                visit(child)
                continue
            unit = shared if shared is not None else []
            if shared is None:
                found.append(unit)
            unit.append(child)
            for p in child.parameters():
                taken.add(id(p))
                owner.setdefault(id(p), unit)

    visit(module)
    left = [name for name, p in module.named_parameters() if id(p) not in taken]
    if left:
        shown = ", ".join(left[:3]) + (f" and {len(left) - 3} more" if len(left) > 3 else "")
        raise ValueError(
            f"Under manual optimization (`automatic_optimization = False`) data parallelism at zero_stage={zero_stage}"
            " gathers a submodule's parameters when the step calls it and reduces their gradients in the backward"
            f" of its output; {shown} belong to no submodule that a step calls (a parameter of the LightningModule"
            " itself, or of a ParameterList/ParameterDict). Move them into a submodule whose forward uses them, or"
            " use automatic optimization (return the loss from training_step)."
        )
    return [unit[0] if len(unit) == 1 else unit for unit in found]


def follow_outputs_into_backward(module: nn.Module, units: Iterable[Any], zero_stage: int) -> None:
    """Each called unit's forward (with gradients on) must return tensors FSDP2 can follow into backward: its
    pre-backward, hooked on them, gathers the parameters again (ZeRO-3 freed them after the forward) and readies
    the reduction of their gradients (and their resharding) at the backward's end.

    FSDP2 looks for them in tuples, lists, dicts, namedtuples and dataclasses only. Tensors a forward returns inside
    another object (PPO's actor returns a ``torch.distributions`` object, whose tensors are its attributes) are
    found in the objects' attributes here and hooked the same way; the output is returned unchanged. Unfollowed,
    such an output crashed in backward at ZeRO-3 and silently trained on stale gathered parameters with unreduced
    gradients at ZeRO-2. A forward in which no tensor that needs a gradient is found is refused, at its first call,
    saying what to change. The hooks are removed with the module's others when it is given back (``patches.py``).
    """
    names = {sub: name for name, sub in module.named_modules()}
    parts = [part for unit in units for part in (unit if isinstance(unit, list) else [unit])]
    for part in parts:

        def follow(
            sub: nn.Module, args: tuple, output: object, name: str = names.get(part, type(part).__name__)
        ) -> None:
            if not torch.is_grad_enabled() or not any(p.requires_grad for p in sub.parameters()):
                return
            seen, inside = grad_tensors(output)
            if inside:
                follow_into_backward(sub, inside)
            if seen or inside:
                return
            raise ValueError(
                f"Under manual optimization data parallelism at zero_stage={zero_stage} makes each submodule a step"
                " calls an FSDP2 unit, which gathers its parameters for the forward and reduces their gradients in"
                f" the backward of its output's tensors; {name} returned {_kinds(output)}, in which no tensor that"
                " needs a gradient was found (looked for in tuples, lists, dicts, dataclasses and the attributes of"
                " other objects), so its gradients would not be reduced nor its parameters gathered again for"
                f" backward. Return the tensors the loss is computed from in {name}'s output, or use zero_stage=0"
                " or 1."
            )

        part.register_forward_hook(follow)


# Objects whose attributes are not looked into: they are no forward's data.
_OPAQUE = (nn.Module, type, types.ModuleType, types.FunctionType, types.MethodType, types.BuiltinFunctionType)
_MAX_DEPTH = 8


def grad_tensors(output: Any) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The tensors that need a gradient in ``output``: those FSDP2 finds itself (in tuples, lists, dicts,
    namedtuples and dataclasses, as ``torch.distributed.fsdp``'s ``collect_grad_tensors``) and those inside other
    objects' attributes (``vars``), e.g. a ``torch.distributions`` object's parameters and their lazily computed
    forms (``probs`` once read), each tensor once."""
    seen: list[torch.Tensor] = []
    inside: list[torch.Tensor] = []
    visited: set[int] = set()

    def walk(obj: Any, hidden: bool, depth: int) -> None:
        if depth > _MAX_DEPTH or id(obj) in visited:
            return
        visited.add(id(obj))
        if torch.is_tensor(obj):
            if obj.requires_grad:
                (inside if hidden else seen).append(obj)
        elif isinstance(obj, (tuple, list)):
            for item in obj:
                walk(item, hidden, depth + 1)
        elif isinstance(obj, dict):
            for item in obj.values():
                walk(item, hidden, depth + 1)
        elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
            for field in dataclasses.fields(obj):
                walk(getattr(obj, field.name, None), hidden, depth + 1)
        elif isinstance(getattr(obj, "__dict__", None), dict) and not isinstance(obj, _OPAQUE):
            for item in list(vars(obj).values()):
                walk(item, True, depth + 1)

    walk(output, False, 0)
    return seen, inside


def _kinds(output: Any) -> str:
    if isinstance(output, (tuple, list)):
        return f"{type(output).__name__}({', '.join(type(item).__name__ for item in output)})"
    return type(output).__name__


def reduce_in_step_only(root: nn.Module) -> None:
    """A DDP root whose step runs its own backwards: no backward of the step's output is expected after it."""
    root.register_forward_hook(lambda module, args, output: skip_ddp_post_forward_reduction(module), prepend=True)


def prepare_backward(roots: Iterable[nn.Module], loss: Any) -> None:
    """Before a ``manual_backward`` of ``loss``: DDP roots' reducers readied for it (FSDP2 units need nothing)."""
    for root in roots:
        if is_ddp_replicated(root):
            prepare_ddp_backward(root, loss)
