"""Modules built without memory: parameters on the meta device, made real only after they are sharded.

A model too big for one host is built with its *parameters* on the meta device (:func:`parameters_on_meta`; the
strategy's ``tensor_init_context`` and ``configure_model`` use it) while its *buffers* are made as usual: the
values a module computes in ``__init__`` (rotary frequencies, causal masks, BatchNorm statistics) are real from the
start and need neither a checkpoint nor an initializer. The strategy parallelizes the meta module (tensor split,
pipeline stages, ZeRO shards), then :func:`materialize` gives each rank memory for the slices it holds only.

Tensors no checkpoint fills (a new head, adapters, the whole model when there are no weights) get what one process
would give them, whatever the layout (:func:`initialize_missing`): each module that owns such a tensor is rebuilt
in full on the CPU, one module at a time, its own initializer runs (Hugging Face's ``_init_weights`` inside a
``PreTrainedModel``, as ``from_pretrained`` does for missing keys; ``reset_parameters()`` elsewhere), in the same
module order and from the same random state on every rank, and each rank keeps its slices. Only modules with
missing tensors draw random numbers, as in ``from_pretrained``. A module that owns a missing tensor and no
initializer is refused by name before anything is allocated.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, cast

import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.nn.modules.module import register_module_parameter_registration_hook

from lightning_mgpu._compat.tensors import module_structure, module_twin


class UninitializableModule(RuntimeError):
    """A module built on the meta device owns a tensor that neither the checkpoint nor an initializer fills."""


@contextmanager
def parameters_on_meta() -> Iterator[None]:
    """Every parameter registered in the block goes to the meta device; buffers stay where they are made.

    A layer's ``torch.empty`` weight is never written before it moves (its initializer then runs on the meta
    tensor), so building a 70B model costs no memory beyond its buffers.
    """

    def to_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> nn.Parameter | None:
        if param is None or param.is_meta:
            return None  # keep it (a tied parameter registered twice stays one object)
        meta = type(param)(param.detach().to("meta"), requires_grad=param.requires_grad)
        meta.__dict__.update(param.__dict__)
        return meta

    handle = register_module_parameter_registration_hook(to_meta)  # type: ignore[arg-type]  # may return one
    try:
        yield
    finally:
        handle.remove()


def has_meta_tensors(module: nn.Module) -> bool:
    tensors = [*module.parameters(), *module.buffers()]
    return any(_is_meta(t) for t in tensors)


def _is_meta(tensor: torch.Tensor) -> bool:
    return (tensor.to_local() if isinstance(tensor, DTensor) else tensor).is_meta


@torch.no_grad()
def materialize(module: nn.Module, device: torch.device) -> None:
    """Memory on ``device`` for every meta tensor of ``module`` (only the local shard of a sharded one), its values
    unset; real tensors move to ``device`` unchanged. Called after the module is parallelized.

    Each meta tensor object is filled in place (``torch.utils.swap_tensors``), so a parameter tied between two
    modules stays one parameter and whatever already holds it (FSDP2, a pipeline's tie, an optimizer) sees the
    real tensor. ``nn.Module.to_empty`` would make new parameter objects and untie them.
    """
    for sub in module.modules():
        for _, tensor in [*sub.named_parameters(recurse=False), *sub.named_buffers(recurse=False)]:
            if _is_meta(tensor):  # a tied tensor is met again, already filled
                torch.utils.swap_tensors(tensor, _empty_like(tensor, device))
    module.to(device)


def _empty_like(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    empty = torch.empty_like(tensor, device=device)
    if isinstance(tensor, nn.Parameter):  # also a DTensor made a parameter
        empty = nn.Parameter(empty, requires_grad=tensor.requires_grad)
    for name, value in tensor.__dict__.items():  # swapped with the payload: the user's attributes stay with it
        empty.__dict__.setdefault(name, value)
    return empty


@dataclass
class _Pending:
    """One module whose own tensors ``names`` no checkpoint fills."""

    module: nn.Module
    fqn: str
    names: list[str]
    initializer: Any  # a callable taking the module (Hugging Face's ``_init_weights``) or None: reset_parameters
    hf: bool = False


@dataclass
class InitPlan:
    """Which modules of the meta-built model need their initializer, in the order one process runs them, and the
    random state they start from. Made before parallelizing (the module tree is whole), run after it."""

    pending: list[_Pending] = field(default_factory=list)
    rng_state: torch.Tensor | None = None

    def __bool__(self) -> bool:
        return bool(self.pending)


def plan_initialization(module: nn.Module, loaded: set[str], rng_state: torch.Tensor | None = None) -> InitPlan:
    """The modules owning a meta parameter or buffer whose state-dict name is not in ``loaded``.

    Raises :class:`UninitializableModule`, naming every such module without an initializer, before any memory is
    allocated.
    """
    plan = InitPlan(rng_state=rng_state)
    refused = []
    for fqn, sub, initializer in _in_initialization_order(module):
        prefix = f"{fqn}." if fqn else ""
        names = [name for name, tensor in _own_tensors(sub).items() if _is_meta(tensor) and prefix + name not in loaded]
        if not names:
            continue
        if initializer is None and not callable(getattr(sub, "reset_parameters", None)):
            refused.append(f"{fqn or type(module).__name__} ({type(sub).__name__}: {', '.join(names)})")
            continue
        plan.pending.append(_Pending(sub, fqn, names, initializer, hf=initializer is not None))
    if refused:
        raise UninitializableModule(
            f"The model was built on the meta device, and {len(refused)} module(s) own tensors that neither the"
            f" checkpoint nor an initializer fills: {'; '.join(refused[:8])}{' ...' if len(refused) > 8 else ''}."
            " Give each such module a `reset_parameters()` method that initializes its own parameters and buffers"
            " (torch's layers have one), include the tensors in the checkpoint, or build the module without"
            " `empty_init` (outside `trainer.init_module(empty_init=True)`)."
        )
    return plan


def _in_initialization_order(module: nn.Module) -> Iterator[tuple[str, nn.Module, Any]]:
    """Every module with the initializer that one process would run on it, children before parents (Hugging Face's
    ``initialize_weights`` order): inside a ``PreTrainedModel`` its ``_init_weights``, elsewhere ``None``
    (``reset_parameters``)."""
    hf_base = _hf_pretrained_base()

    def visit(fqn: str, sub: nn.Module, owner: Any) -> Iterator[tuple[str, nn.Module, Any]]:
        if hf_base is not None and isinstance(sub, hf_base):
            owner = sub
        for name, child in sub.named_children():
            yield from visit(f"{fqn}.{name}" if fqn else name, child, owner)
        yield fqn, sub, owner._init_weights if owner is not None else None

    yield from visit("", module, None)


def _hf_pretrained_base() -> type | None:
    try:
        from transformers import PreTrainedModel
    except ImportError:
        return None
    return PreTrainedModel


@torch.no_grad()
def initialize_missing(plan: InitPlan) -> None:
    """Run ``plan`` on the materialized module: each pending module's initializer on a full-size CPU copy of its own
    tensors, from ``plan.rng_state``, every rank alike; each rank copies the slices it holds. The random state
    outside is left as it was."""
    with torch.random.fork_rng(devices=[]):
        if plan.rng_state is not None:
            torch.set_rng_state(plan.rng_state)
        for pending in plan.pending:
            _initialize_one(pending)


def _initialize_one(pending: _Pending) -> None:
    sub = pending.module
    live = _own_tensors(sub)
    parameters = {name for name, _ in sub.named_parameters(recurse=False)}
    full = {}
    for name, tensor in live.items():
        value = torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu")
        if name in parameters:
            value = nn.Parameter(value, requires_grad=False)
        if name in pending.names:
            value.fill_(float("nan")) if value.is_floating_point() else value.zero_()
        else:
            value._is_hf_initialized = True  # type: ignore[attr-defined]  # Hugging Face's initializers skip it
        full[name] = value
    # The module's own attributes (config, sizes) and code, its own tensors full-size on the CPU.
    _, slots, buffer_slots = module_structure(sub)  # `None` slots too: an initializer reads `module.bias`
    own = {n: cast(nn.Parameter | None, full.get(n)) for n in slots}
    twin = module_twin(sub, own, {n: full.get(n) for n in buffer_slots})
    if pending.hf:
        _run_hf_initializer(pending.initializer, twin)
    else:
        cast(Any, twin).reset_parameters()
    left = [n for n in pending.names if full[n].is_floating_point() and full[n].isnan().any()]
    if left:
        how = f"{type(sub).__name__}.reset_parameters()" if not pending.hf else "its Hugging Face `_init_weights`"
        raise UninitializableModule(
            f"{pending.fqn or type(sub).__name__}: {how} left {', '.join(left)} uninitialized (the model was built on"
            " the meta device and the checkpoint has no value for it). Initialize every parameter and buffer of the"
            " module there, include it in the checkpoint, or build the module without `empty_init`."
        )
    for name in pending.names:
        _copy_into(live[name], full[name])


def _own_tensors(module: nn.Module) -> dict[str, torch.Tensor]:
    """The module's own parameters and buffers by name (not its children's)."""
    return dict([*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)])


def _run_hf_initializer(init_weights: Any, twin: nn.Module) -> None:
    from transformers import initialization

    with initialization.guard_torch_init_functions():
        init_weights(twin)


def _copy_into(live: torch.Tensor, full: torch.Tensor) -> None:
    """``full`` (the whole tensor) into ``live``: a rank's shard of a DTensor, a plain tensor, or nothing where the
    tensor lives on other ranks (a pipeline stage's or an expert's module this rank does not hold)."""
    if isinstance(live, DTensor):
        local = live.to_local()
        if local.is_meta:
            return
        shard = distribute_tensor(full, live.device_mesh, live.placements, src_data_rank=None).to_local()
        local.copy_(shard)
        return
    if live.is_meta:
        return
    live.copy_(full)
