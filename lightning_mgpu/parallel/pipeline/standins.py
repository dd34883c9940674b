"""Stand-ins for the modules of a pipelined model that this rank does not run (see ``pipeline``).

A rank keeps its stages' blocks; in place of the others it puts modules without parameters that let the user's
whole network call run on every stage: a block of another stage passes its input on, a prologue module (embeddings)
returns zeros shaped like its output (only the first stage computes it; the others take the received activation
instead, or the value the first stage sent where later blocks read it: ``carry.py``), an epilogue module (norm,
head) is never reached. ``PipelineRuntime.unsplit`` puts the originals back.

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
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NoReturn

import torch
from torch import nn

from lightning_mgpu._compat.tensors import tree_map
from lightning_mgpu.parallel.pipeline.carry import CarriedValues


@dataclass
class ValueCheck:
    """Shared by a rank's stand-ins: while ``on``, they return NaN where their values would otherwise be used, the
    last such tensor kept in ``last`` (a stage's first block must get that one, untouched, to replace it)."""

    on: bool = False
    last: torch.Tensor | None = None


def marked(value: object, check: ValueCheck) -> object:
    """``value``, or NaN of its shape while ``check.on`` (a floating-point tensor: other values cannot carry NaN)."""
    if check.on and torch.is_tensor(value) and value.is_floating_point():
        value = check.last = torch.full_like(value, float("nan"))
    return value


def first_input(args: tuple, kwargs: dict) -> object:
    """A block's hidden-state input: its first argument, positional or (for ``block(hidden_states=x)``) keyword."""
    return args[0] if args else next(iter(kwargs.values()))


def meta_copy(module: nn.Module) -> nn.Module:
    """``module`` copied onto the meta device: its structure and attributes without its values (the parameters
    and buffers are made on the meta device directly, never copied)."""
    memo: dict[int, torch.Tensor] = {}
    for param in module.parameters():
        memo[id(param)] = nn.Parameter(param.detach().to("meta"), requires_grad=param.requires_grad)
    for buffer in module.buffers():
        memo[id(buffer)] = buffer.detach().to("meta")
    return copy.deepcopy(module, memo).to("meta")


class _StandsForBlock(nn.Module):
    """A stand-in for a block that answers what the model's code reads of the block besides calling it
    (``nn.TransformerEncoder``/``Decoder`` look at ``self.layers[0].self_attn.batch_first`` before running their
    layers) from ``self._original[0]``."""

    _original: list[nn.Module]

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            original = vars(self).get("_original")
            if not original:
                raise
            return getattr(original[0], name)


class PassThrough(_StandsForBlock):
    """A block owned by another rank: hands its input on unchanged (its stage's output replaces it later).

    What the model's code reads of the block is read from a meta-device copy of it, whose weights are on the meta
    device: code that would compute with them (torch's fused fast path for encoder layers, which checks its weights'
    device first) takes its ordinary path.
    """

    def __init__(self, check: ValueCheck, original: nn.Module | None = None) -> None:
        super().__init__()
        self._check = check
        self._original = [meta_copy(original)] if original is not None else []  # in a list: not a submodule

    def forward(self, *args: object, **kwargs: object) -> object:
        return marked(first_input(args, kwargs), self._check)


class ArgumentRecorder(_StandsForBlock):
    """In place of one of a rank's own blocks while a stage finds what it takes from the first stage
    (``carry.py``): records the block's arguments into ``carried`` (the finding stage's blocks) and hands its input
    on; the stage's last block ends the call (``done(output)`` makes the exception that does). The block itself is
    not called: none of its hooks (a data-parallel wrap's) run outside its stage's forward."""

    def __init__(
        self, block: nn.Module, carried: CarriedValues | None, done: Callable[[object], BaseException] | None
    ) -> None:
        super().__init__()
        self._original = [block]
        self._carried = carried
        self._done = done

    def forward(self, *args: object, **kwargs: object) -> object:
        if self._carried is not None:
            self._carried.block_arguments(args, kwargs)
        if self._done is not None:
            raise self._done(None)
        return first_input(args, kwargs)


class Placeholder(nn.Module):
    """A prologue module owned by the first stage: returns zeros shaped like its real output.

    The shape comes from running a meta-device copy once per distinct input shape.
    """

    def __init__(
        self, original: nn.Module, check: ValueCheck, name: str = "", carried: CarriedValues | None = None
    ) -> None:
        super().__init__()
        self._meta = [meta_copy(original)]  # in a list: not a submodule, no parameters
        self._check = check
        self._name = name  # the FQN it stands at, under which ``carried`` knows it
        self._carried = carried
        self._outputs: dict[tuple[object, object], object] = {}  # by (input shapes and dtypes, autocast)

    def forward(self, *args: object, **kwargs: object) -> object:
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
            made = marked(torch.zeros(output.shape, dtype=output.dtype, device=device), check)
        else:
            zeros = lambda t: (
                marked(torch.zeros(t.shape, dtype=t.dtype, device=device), check) if torch.is_tensor(t) else t
            )
            made = tree_map(zeros, output)
        # Values later stages take from the first stage (an encoder's output) replace their zeros (carry.py).
        return made if self._carried is None else self._carried.placeholder_output(self._name, made)


class Unreachable(nn.Module):
    """An epilogue module (norm, head) owned by the last stage; earlier stages end before reaching it."""

    def forward(self, *args: object, **kwargs: object) -> NoReturn:
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
