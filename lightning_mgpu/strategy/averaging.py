"""Lightning's ``WeightAveraging`` (``EMAWeightAveraging``, custom subclasses) under sharded layouts.

The callback's ``setup`` deep-copies the plain module into an ``AveragedModel`` before the strategy parallelizes
it; afterwards it pairs the copy's parameters and buffers with the module's by position (``update_parameters``,
``_swap_models``, ``_copy_average_to_current``). Under tensor parallelism and ZeRO-2/3 the module's are DTensors:
once the module is parallelized, each of the copy's tensors is replaced by one laid out as the module's (same
names, order and placements; tied ones kept tied), so that every pairing is elementwise on equal shards. The
copy's own tensors (emptied while the run trains) are put back at teardown, holding the averages gathered whole.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from lightning_mgpu._compat.lightning import weight_averaging_copy, weight_averaging_device, weight_averaging_transfers
from lightning_mgpu._compat.tensors import module_structure, set_module_structure
from lightning_mgpu.patches import PatchLog


class AveragedCopies:
    """The re-pointed copies of one run: ``gather`` (collective) gives the copies' own tensors the averages before
    the run's patches put those tensors back."""

    def __init__(self) -> None:
        self._originals: list[tuple[torch.Tensor, torch.Tensor]] = []  # (the copy's own tensor, its replacement)

    def gather(self) -> None:
        with torch.no_grad():
            for original, replacement in self._originals:
                value = replacement.full_tensor() if isinstance(replacement, DTensor) else replacement
                original.data = value.detach().to(original.device)
        self._originals.clear()

    def repoint(
        self, callbacks: Sequence[Any], module: nn.Module, before_transfers: Callable[[], None], patches: PatchLog
    ) -> None:
        """Every ``WeightAveraging`` callback's copy laid out as ``module`` (already parallelized); its transfers
        run ``before_transfers`` first (FSDP groups an evaluation left gathered are sharded again)."""
        from lightning.pytorch.callbacks import WeightAveraging

        self._originals.clear()  # an earlier run's, not gathered (it failed, or left the module parallelized)
        for callback in callbacks:
            if not isinstance(callback, WeightAveraging):
                continue
            averaged = weight_averaging_copy(callback)
            if averaged is None or not _holds_dtensors(module):
                continue
            _refuse_another_device(callback, module)
            self._originals += _repoint_copy(averaged.module, module, int(averaged.n_averaged), patches)
            _guard_transfers(callback, averaged, before_transfers, patches)


def _holds_dtensors(module: nn.Module) -> bool:
    return any(isinstance(t, DTensor) for t in (*module.parameters(), *module.buffers()))


def _refuse_another_device(callback: Any, module: nn.Module) -> None:
    """A DTensor lives on its mesh's devices: the copy cannot be kept elsewhere (``WeightAveraging(device=...)``)."""
    device = weight_averaging_device(callback)
    here = next(module.parameters()).device
    if device is not None and torch.device(device).type != here.type:
        raise ValueError(
            f"{type(callback).__name__}(device={device!r}) keeps its averaged copy on another device than the"
            f" module's ({here}); under sharded layouts the copy is sharded as the module is, on the same devices."
            " Leave `device` unset."
        )


def _repoint_copy(
    copy: nn.Module, module: nn.Module, n_averaged: int, patches: PatchLog
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each of ``copy``'s parameters and buffers replaced by one laid out as ``module``'s of the same name: a clone
    of the module's current value while nothing was averaged yet (the average *is* the initial weights; also
    right where the module's weights were filled at setup), else the copy's own value distributed the same way.
    Returns (original, replacement) pairs; the undo is registered in ``patches``."""
    _check_same_names(copy, module)
    targets = dict(module.named_buffers(remove_duplicate=False)) | dict(module.named_parameters(remove_duplicate=False))
    made: dict[int, torch.Tensor] = {}  # by the module's tensor: tied parameters stay tied
    pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
    for prefix, sub in copy.named_modules():
        before = module_structure(sub)
        children, parameters, buffers = module_structure(sub)
        for store in (parameters, buffers):
            for name, own in store.items():
                target = targets.get(f"{prefix}.{name}" if prefix else name)
                if own is None or not isinstance(target, DTensor):
                    continue
                if id(target) not in made:
                    made[id(target)] = _laid_out_as(own, target, n_averaged, store is parameters)
                    pairs.append((own, made[id(target)]))
                    own.data = own.data.new_empty(0)  # the copy's whole tensor holds no memory while it trains
                store[name] = made[id(target)]
        set_module_structure(sub, children, parameters, buffers)
        patches.add(partial(set_module_structure, sub, *before))
    _check_same_pairing(copy, module)
    return pairs


def _laid_out_as(own: torch.Tensor, target: DTensor, n_averaged: int, parameter: bool) -> torch.Tensor:
    with torch.no_grad():
        if n_averaged == 0:
            value = target.detach().clone()
        else:  # resumed or reused: the averages are the copy's, whole on every rank
            whole = own.full_tensor() if isinstance(own, DTensor) else own
            value = distribute_tensor(
                whole.detach().to(target.device, target.dtype),
                target.device_mesh,
                target.placements,
                src_data_rank=None,
            )
    return nn.Parameter(value, requires_grad=False) if parameter else value


def _check_same_names(copy: nn.Module, module: nn.Module) -> None:
    """The callback pairs by position: the parallelized module must list what the copy lists, in its order."""
    for what, names in (("parameters", nn.Module.named_parameters), ("buffers", nn.Module.named_buffers)):
        mine, theirs = [n for n, _ in names(copy)], [n for n, _ in names(module)]
        if mine != theirs:
            raise RuntimeError(
                f"lightning-mgpu cannot lay out the weight-averaging copy as the parallelized module: their {what}"
                f" differ ({sorted(set(mine) ^ set(theirs))[:5]} ...). Please report this."
            )


def _check_same_pairing(copy: nn.Module, module: nn.Module) -> None:
    pairs = zip([*copy.parameters(), *copy.buffers()], [*module.parameters(), *module.buffers()], strict=True)
    for own, live in pairs:
        if isinstance(live, DTensor) and not (isinstance(own, DTensor) and own.placements == live.placements):
            raise RuntimeError(
                "lightning-mgpu could not pair the weight-averaging copy with the parallelized module (a tied"
                " parameter the layout untied?). Please report this."
            )


def _guard_transfers(callback: Any, averaged: Any, before: Callable[[], None], patches: PatchLog) -> None:
    """``before`` runs ahead of each of the callback's copies between the module and its average: after an
    evaluation (the swap at validation's end, an update at an epoch's end) FSDP can leave a group gathered, with
    plain unsharded tensors registered in place of the sharded parameters the copy is paired with."""

    def guarded(method: Callable[..., None]) -> Callable[..., None]:
        def run(*args: Any, **kwargs: Any) -> None:
            before()
            method(*args, **kwargs)

        return run

    for name, method in weight_averaging_transfers(callback).items():
        patches.set_attribute(callback, name, guarded(method))
    patches.set_attribute(averaged, "update_parameters", guarded(averaged.update_parameters))
