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

import math
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
    """One module whose own tensors ``names`` no checkpoint fills, and what initializes them."""

    module: nn.Module
    fqn: str
    names: list[str]
    initializer: Initializer


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
        if initializer is None:
            refused.append(f"{fqn or type(module).__name__} ({type(sub).__name__}: {', '.join(names)})")
            continue
        plan.pending.append(_Pending(sub, fqn, names, initializer))
    if refused:
        raise UninitializableModule(
            f"The model was built on the meta device, and {len(refused)} module(s) own tensors that neither the"
            f" checkpoint nor an initializer fills: {'; '.join(refused[:8])}{' ...' if len(refused) > 8 else ''}."
            " Give each such module a `reset_parameters()` method that initializes its own parameters and buffers"
            " (torch's layers have one), include the tensors in the checkpoint, or build the module without"
            " `empty_init` (outside `trainer.init_module(empty_init=True)`)."
        )
    return plan


class Initializer:
    """What one process runs on a module to give its own tensors their first values (``__call__`` on a copy of the
    module holding full-size tensors)."""

    def __init__(self, run: Any, name: str, hugging_face: bool = False) -> None:
        self.run = run
        self.name = name
        self.hugging_face = hugging_face  # its functions skip tensors flagged `_is_hf_initialized` (loaded ones)

    def __call__(self, twin: nn.Module) -> None:
        if not self.hugging_face:
            self.run(twin)
            return
        from transformers import initialization

        with initialization.guard_torch_init_functions():
            self.run(twin)


def _in_initialization_order(module: nn.Module) -> Iterator[tuple[str, nn.Module, Initializer | None]]:
    """Every module with the initializer one process would run on it, children before parents (Hugging Face's
    ``initialize_weights`` order): a LoRA adapter's as ``peft`` initializes it when it adds the adapter; inside a
    ``PreTrainedModel`` its ``_init_weights`` (what ``from_pretrained`` runs on missing weights); elsewhere the
    module's ``reset_parameters()``; None where there is none."""
    hf_base = _hf_pretrained_base()

    def visit(fqn: str, sub: nn.Module, owner: Any, adapter: Initializer | None, adapters: Any) -> Iterator[Any]:
        if hf_base is not None and isinstance(sub, hf_base):
            owner = sub
        for name, child in sub.named_children():
            # An adapter dict's entries (`lora_A.default`) get their initializer from the LoRA layer above the dict.
            inherited = adapters(name) if adapters is not None else None
            below = _lora_initializers(module, sub, name)
            yield from visit(f"{fqn}.{name}" if fqn else name, child, owner, inherited, below)
        if adapter is not None:
            yield fqn, sub, adapter
        elif owner is not None:
            yield fqn, sub, Initializer(owner._init_weights, f"{type(owner).__name__}._init_weights", True)
        elif callable(getattr(sub, "reset_parameters", None)):
            yield (
                fqn,
                sub,
                Initializer(lambda twin: twin.reset_parameters(), f"{type(sub).__name__}.reset_parameters()"),
            )
        else:
            yield fqn, sub, None

    yield from visit("", module, None, None, None)


def _lora_initializers(root: nn.Module, layer: nn.Module, dict_name: str) -> Any:
    """For the adapters a ``peft`` LoRA layer holds (``lora_A``/``lora_B``, one entry per adapter name), a function
    from an adapter name to its initializer: the values ``peft`` gives it when it adds the adapter, drawn in the same
    order. ``LoraLayer.update_layer`` builds A and B as torch Linears (each drawing torch's default initialization),
    then ``reset_lora_parameters`` draws A again (torch's Linear default, or Gaussian) and zeroes B. The data-dependent
    initializations (PiSSA, OLoRA, LoftQ, ...) need the pretrained weights and are refused."""
    if dict_name not in ("lora_A", "lora_B") or not callable(getattr(layer, "reset_lora_parameters", None)):
        return None
    how = _lora_init_setting(root)
    if how not in (True, "gaussian"):
        raise UninitializableModule(
            f"LoRA adapters initialized with init_lora_weights={how!r} compute their values from the pretrained"
            " weights, which are not loaded yet when the model is built on the meta device. Use"
            " init_lora_weights=True or 'gaussian', or build the model with its weights (from_pretrained in"
            " __init__) and apply LoRA there."
        )

    def for_adapter(adapter: str) -> Initializer:
        b = cast(nn.Linear, cast(Any, layer).lora_B[adapter])

        def init(twin: nn.Module) -> None:
            weight = cast(torch.Tensor, twin.weight)
            bias = getattr(twin, "bias", None)
            if dict_name == "lora_B":  # its draws were made with A's
                nn.init.zeros_(weight)
                if bias is not None:
                    nn.init.zeros_(bias)
                return
            _reset_parameters(twin)  # A built as a Linear
            nn.Linear(b.in_features, b.out_features, bias=b.bias is not None, device="cpu")  # B built as one
            if how is True:
                nn.init.kaiming_uniform_(weight, a=math.sqrt(5))
            else:
                nn.init.normal_(weight, std=1 / cast(Any, layer).r[adapter])

        return Initializer(init, f"peft's LoRA initialization (init_lora_weights={how!r})")

    return for_adapter


def _reset_parameters(twin: nn.Module) -> None:
    cast(Any, twin).reset_parameters()


def _lora_init_setting(root: nn.Module) -> Any:
    """The ``init_lora_weights`` of the ``peft`` model inside ``root`` (its first adapter's)."""
    for sub in root.modules():
        configs = getattr(sub, "peft_config", None)
        if isinstance(configs, dict) and configs:
            return getattr(next(iter(configs.values())), "init_lora_weights", True)
    return True


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
    pending.initializer(twin)
    left = [n for n in pending.names if full[n].is_floating_point() and full[n].isnan().any()]
    if left:
        how = pending.initializer.name
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
