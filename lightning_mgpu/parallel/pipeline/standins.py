"""Stand-ins for the modules of a pipelined model that this rank does not run (see ``pipeline``).

A rank keeps its stages' blocks; in place of the others it puts modules without parameters that let the user's
whole network call run on every stage: a block of another stage passes its input on, a prologue module (embeddings)
returns zeros shaped like its output (only the first stage computes it; the others take the received activation
instead), an epilogue module (norm, head) is never reached. ``PipelineRuntime.unsplit`` puts the originals back.

Their values must not matter: a stage replaces its first block's input with the activation it received, and nothing
else may depend on them. A model whose blocks also take the embeddings (an ``x0`` skip connection, value embeddings)
or another stage's block outputs (U-Net-style skips) would compute with stand-in values and train wrong. So a
stage's first real forward runs with ``ValueCheck.on``: the stand-ins return NaN instead (``marked``), and a NaN in
the stage's output shows that it depends on them, and so does a first block input that is not the last stand-in's
output as it was (code between two blocks at the stage's start, which only the previous stage could run); ``Stage``
then refuses the model.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from lightning_mgpu._compat.tensors import tree_map


@dataclass
class ValueCheck:
    """Shared by a rank's stand-ins: while ``on``, they return NaN where their values would otherwise be used, the
    last such tensor kept in ``last`` (a stage's first block must get that one, untouched, to replace it)."""

    on: bool = False
    last: torch.Tensor | None = None


def marked(value: Any, check: ValueCheck) -> Any:
    """``value``, or NaN of its shape while ``check.on`` (a floating-point tensor: other values cannot carry NaN)."""
    if check.on and torch.is_tensor(value) and value.is_floating_point():
        value = check.last = torch.full_like(value, float("nan"))
    return value


def first_input(args: tuple, kwargs: dict) -> Any:
    """A block's hidden-state input: its first argument, positional or (for ``block(hidden_states=x)``) keyword."""
    return args[0] if args else next(iter(kwargs.values()))


class PassThrough(nn.Module):
    """A block owned by another rank: hands its input on unchanged (its stage's output replaces it later)."""

    def __init__(self, check: ValueCheck) -> None:
        super().__init__()
        self._check = check

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return marked(first_input(args, kwargs), self._check)


class Placeholder(nn.Module):
    """A prologue module owned by the first stage: returns zeros shaped like its real output.

    The shape comes from running a meta-device copy once per distinct input shape.
    """

    def __init__(self, original: nn.Module, check: ValueCheck) -> None:
        super().__init__()
        self._meta = [copy.deepcopy(original).to("meta")]  # in a list: not a submodule, no parameters
        self._check = check
        self._outputs: dict[Any, Any] = {}

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        tensors = [t for t in (*args, *kwargs.values()) if torch.is_tensor(t)]
        device = tensors[0].device if tensors else None
        autocast = (torch.is_autocast_enabled(device.type), torch.get_autocast_dtype(device.type)) if device else None
        key = (tuple((tuple(t.shape), t.dtype) for t in tensors), autocast)
        output = self._outputs.get(key)
        if output is None:
            to_meta = lambda t: t.to("meta") if torch.is_tensor(t) else t
            output = self._outputs[key] = self._meta[0](*tree_map(to_meta, args), **tree_map(to_meta, kwargs))
        check = self._check
        if torch.is_tensor(output):  # an embedding's output: no tree walk (this runs on every microbatch)
            return marked(torch.zeros(output.shape, dtype=output.dtype, device=device), check)
        zeros = lambda t: marked(torch.zeros(t.shape, dtype=t.dtype, device=device), check) if torch.is_tensor(t) else t
        return tree_map(zeros, output)


class Unreachable(nn.Module):
    """An epilogue module (norm, head) owned by the last stage; earlier stages end before reaching it."""

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("lightning-mgpu: a pipeline stage ran past its last block; please report this.")


def keep_tied_names(module: nn.Module, standins: list[tuple[nn.Module, nn.Module]]) -> None:
    """Stand-ins keep the tied weights their modules shared with modules this rank kept, under the same names.

    So a tied weight has all its names on every rank that holds it, as in one process: state-dict and optimizer
    keys match a single-process checkpoint (one optimizer state under its first name), and a data-parallel wrap
    of the stage replaces the Parameter under every name at once.
    """
    kept = {id(p) for p in module.parameters()}
    for standin, original in standins:
        for name, param in original.named_parameters(recurse=False):
            if id(param) in kept:
                standin.register_parameter(name, param)


def replace_module(module: nn.Module, fqn: str, new: nn.Module) -> None:
    parent_name, _, name = fqn.rpartition(".")
    parent = module.get_submodule(parent_name) if parent_name else module
    if isinstance(parent, (nn.ModuleList, nn.Sequential)) and name.isdigit():
        parent[int(name)] = new
    else:
        setattr(parent, name, new)
