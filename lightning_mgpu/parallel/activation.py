"""Activation checkpointing per block, keeping every parameter's name.

Applied after tensor parallelism and before the pipeline split and the data-parallel wrap, so it composes with all
of them. Each chosen module's ``forward`` is replaced (on the instance) by one that runs the original forward under
``torch.utils.checkpoint.checkpoint(use_reentrant=False)``. No wrapper module is inserted, so ``state_dict()`` keys,
optimizer parameter names and checkpoints are those of the plain model (torch's ``checkpoint_wrapper`` would add
``_checkpoint_wrapped_module.`` to every key inside a block). Hooks that other parallelizers put on the module
(FSDP2 unshard/reshard, tensor-parallel redistribution) stay outside the checkpointed region; the recomputation in
backward runs the same forward under the same autocast state, so losses and gradients are bit-identical.

Modes (``activation_checkpointing=`` of :class:`~lightning_mgpu.HybridStrategy`):

- ``False``: off.
- ``True`` / ``"full"``: every repeated block (``parallel.blocks.find_blocks``) keeps only its input; everything
  inside is recomputed in backward (one extra forward per block).
- ``"selective"``: op-level selective checkpointing per block (``create_selective_checkpoint_contexts``): the
  outputs of matmuls (``mm``, ``addmm``, ``bmm``, attention kernels, float8 ``_scaled_mm``) and of collectives are
  saved; cheap ops (norms, activations, softmax, residual adds, dtype casts) are recomputed. Less memory saved
  than ``"full"``, but no matmul or communication is repeated.
- a list of module classes: full checkpointing of every outermost module of those classes (for models without a
  repeated block list, or to choose the granularity).
"""

from __future__ import annotations

import types
from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager
from functools import partial
from typing import TYPE_CHECKING, Any, Literal

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from lightning_mgpu._compat.c10d import FUNCTIONAL_OPS
from lightning_mgpu._compat.tensors import TorchDispatchMode, tree_leaves
from lightning_mgpu.parallel.blocks import find_blocks

if TYPE_CHECKING:
    from torch.multiprocessing.reductions import StorageWeakRef

    from lightning_mgpu._compat.tensors import OpOverload

Mode = bool | str | list[type] | tuple[type, ...]
Recomputation = Literal["none", "full", "selective"]

_INNER_FORWARD = "_mgpu_checkpointed_forward"


def _saved_ops() -> set[OpOverload]:
    """Ops whose outputs "selective" keeps: the expensive ones (matmuls, attention) and communication."""
    aten = torch.ops.aten
    names = [
        (aten, "mm"),
        (aten, "addmm"),
        (aten, "bmm"),
        (aten, "baddbmm"),
        (aten, "_scaled_mm"),
        (aten, "_scaled_dot_product_flash_attention"),
        (aten, "_scaled_dot_product_efficient_attention"),
        (aten, "_scaled_dot_product_cudnn_attention"),
        (aten, "_scaled_dot_product_flash_attention_for_cpu"),
        (aten, "_flash_attention_forward"),
        (aten, "_efficient_attention_forward"),
    ]
    c10d = FUNCTIONAL_OPS
    if c10d is not None:
        names += [
            (c10d, "all_reduce"),
            (c10d, "reduce_scatter_tensor"),
            (c10d, "all_gather_into_tensor"),
            (c10d, "all_to_all_single"),
        ]
    ops: set[OpOverload] = set()
    for namespace, name in names:
        packet = getattr(namespace, name, None)
        if packet is not None:
            ops.update(getattr(packet, overload) for overload in packet.overloads())
    return ops


_SAVED_OPS: set[OpOverload] = set()


def _selective_policy(ctx: object, op: OpOverload, *args: object, **kwargs: object) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in _SAVED_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def _selective_context() -> tuple[AbstractContextManager[object], AbstractContextManager[object]]:
    if not _SAVED_OPS:
        _SAVED_OPS.update(_saved_ops())
    return create_selective_checkpoint_contexts(_selective_policy)


def recomputation(mode: Mode) -> Recomputation:
    """What backward recomputes under ``mode``: ``"none"`` (False), ``"selective"``, or ``"full"`` (True, "full"
    and a list of classes: those modules' whole forward). The planner's cost of a mode reads it."""
    if mode is False:
        return "none"
    return "selective" if mode == "selective" else "full"


def checkpoint_targets(module: nn.Module, mode: Mode, blocks: list[nn.Module] | None = None) -> list[nn.Module]:
    """The modules ``mode`` checkpoints in ``module`` (outermost matches only for a list of classes).

    ``blocks`` replaces the search for repeated blocks.
    """
    if mode is False:
        return []
    if mode is True or mode in ("full", "selective"):
        blocks = find_blocks(module) if blocks is None else blocks
        if not blocks:
            raise ValueError(
                f"activation_checkpointing={mode!r} found no repeated blocks (a ModuleList/Sequential of 2+ layers of"
                f" one class) in {type(module).__name__}. Pass the module classes to checkpoint instead, e.g."
                " activation_checkpointing=[MyBlock]."
            )
        return blocks
    if isinstance(mode, (list, tuple)) and mode and all(isinstance(c, type) for c in mode):
        classes = tuple(mode)
        targets: list[nn.Module] = []
        inside: set[int] = set()
        for child in module.modules():
            if id(child) in inside:
                continue
            if isinstance(child, classes):
                targets.append(child)
                inside.update(id(m) for m in child.modules())
        if not targets:
            names = ", ".join(c.__name__ for c in classes)
            raise ValueError(f"activation_checkpointing=[{names}] matches no module of {type(module).__name__}.")
        return targets
    raise ValueError(
        "`activation_checkpointing` must be False, True, 'full', 'selective' or a list of module classes,"
        f" got {mode!r}."
    )


def apply_activation_checkpointing(
    module: nn.Module, mode: Mode, blocks: list[nn.Module] | None = None
) -> list[nn.Module]:
    """Checkpoint the activations of ``module``'s blocks (or of the given classes) in place; return the targets.

    ``blocks``: the blocks to use for ``True``/``"full"``/``"selective"`` instead of ``find_blocks(module)``.
    State-dict keys are unchanged. Applying it twice to a module is an error (it would recompute twice).

    With pipeline parallelism apply it *before* the split (``parallelize`` does): the split's gate around each
    owned block swaps in the received activation and must stay outside the checkpointed region.
    """
    targets = checkpoint_targets(module, mode, blocks)
    context_fn = _selective_context if mode == "selective" else None
    for target in targets:
        if hasattr(target, _INNER_FORWARD):
            raise RuntimeError(f"activation checkpointing is already applied to {type(target).__name__}.")
        # A bound method (not a closure) so that deep copies of the model call their own forward.
        setattr(target, _INNER_FORWARD, target.forward)
        target.forward = types.MethodType(partial(_checkpointed_forward, context_fn=context_fn), target)
    return targets


def is_checkpointed(module: nn.Module) -> bool:
    return hasattr(module, _INNER_FORWARD)


def _checkpointed_forward(
    self: nn.Module, *args: object, context_fn: Callable[[], object] | None = None, **kwargs: object
) -> object:
    inner = getattr(self, _INNER_FORWARD)
    if not torch.is_grad_enabled():
        return inner(*args, **kwargs)  # evaluation: nothing is saved anyway
    # Any: unpacked into `checkpoint`'s typed keyword parameters.
    extra: dict[str, Any] = {"context_fn": context_fn} if context_fn is not None else {}
    return checkpoint(inner, *args, use_reentrant=False, **extra, **_without_cache(self, kwargs))


_CACHE_ARGUMENTS = ("past_key_values", "past_key_value", "layer_past")


def _without_cache(block: nn.Module, kwargs: dict[str, object]) -> dict[str, Any]:  # Any: as `extra`
    """A block's keyword arguments without its key/value cache, as transformers' own gradient checkpointing drops
    it: the recomputation in backward would append the keys to the cache a second time."""
    dropped = [k for k in _CACHE_ARGUMENTS if kwargs.get(k) is not None]
    if not dropped and not kwargs.get("use_cache"):
        return kwargs
    if type(block) not in _warned_cache:
        _warned_cache.add(type(block))
        rank_zero_warn(
            f"activation_checkpointing: {type(block).__name__} is called with a key/value cache, which recomputing"
            " it in backward would fill twice; it runs without one in training (as transformers' gradient"
            " checkpointing does). The loss is unchanged."
        )
    return {**kwargs, **dict.fromkeys(dropped), **({"use_cache": False} if kwargs.get("use_cache") else {})}


_warned_cache: set[type] = set()


class ActivationMemory:
    """Measure the tensor memory a forward leaves for backward, and the peak over forward + backward.

    A ``TorchDispatchMode`` records the storage of every tensor an op creates while the context is active (DTensors
    by their local tensors). ``held_bytes()`` is the size of those still alive, e.g. right after forward: the
    activations autograd keeps for backward (minus ``exclude``, e.g. the parameters' storages). ``peak_bytes`` is the
    largest total alive after any op. Only tensors created inside the context count, so parameters, gradients kept
    from earlier steps and optimizer states are left out. Slow (a Python call per op): for measuring, not training.
    """

    def __init__(self) -> None:
        tracker = self

        class _Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
                out = func(*args, **(kwargs or {}))
                tracker._record(out)
                return out

        self._mode = _Mode()
        self._storages: dict[int, tuple[StorageWeakRef, int]] = {}
        self.peak_bytes = 0

    def __enter__(self) -> ActivationMemory:
        self._mode.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._mode.__exit__(*exc)

    def _record(self, out: object) -> None:
        from torch.distributed.tensor import DTensor
        from torch.multiprocessing.reductions import StorageWeakRef

        for tensor in tree_leaves(out):
            if not isinstance(tensor, torch.Tensor):
                continue
            if isinstance(tensor, DTensor):
                with torch.no_grad():  # the stored local tensor itself, no autograd view
                    tensor = tensor.to_local()
            if tensor.device.type == "meta":
                continue
            storage = tensor.untyped_storage()
            key = storage.data_ptr()
            entry = self._storages.get(key)
            if entry is None or entry[0].expired():
                self._storages[key] = (StorageWeakRef(storage), storage.nbytes())
        self.peak_bytes = max(self.peak_bytes, self.held_bytes())

    def held_bytes(self, exclude: Iterable[torch.Tensor] = ()) -> int:
        """Bytes of the recorded storages still alive, leaving out tensors in ``exclude`` (e.g. parameters)."""
        from torch.distributed.tensor import DTensor

        with torch.no_grad():  # to_local: the stored local tensor itself
            excluded = {(t.to_local() if isinstance(t, DTensor) else t).untyped_storage().data_ptr() for t in exclude}
        for key in [k for k, (ref, _) in self._storages.items() if ref.expired()]:
            del self._storages[key]
        return sum(size for key, (_, size) in self._storages.items() if key not in excluded)
