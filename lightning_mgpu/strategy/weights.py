"""Where a run's weights come from: pretrained files, the module's own initializers, or the module as built.

``HybridStrategy.setup`` plans before parallelizing (:func:`plan_weights`: the checkpoint's names checked against
the whole module, the initialization of what it lacks planned; no tensor read) and fills after it
(:func:`fill_weights`: memory for the slices each rank holds, initializers, the checkpoint's slices read, then a
check that nothing is NaN or infinite). A module built normally keeps its own values where no checkpoint replaces
them; a module built with its parameters on the meta device is never whole on any rank.
"""

from __future__ import annotations

import os
from collections.abc import Generator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch.strategies.parallel import ParallelStrategy
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import nn
from torch.distributed.tensor import DTensor
from typing_extensions import override

from lightning_mgpu.checkpoint.pretrained import WeightMap, WeightsSource, load_weights, map_weights, open_weights
from lightning_mgpu.extras import require
from lightning_mgpu.parallel.materialize import (
    InitPlan,
    has_meta_tensors,
    initialize_missing,
    materialize,
    parameters_on_meta,
    plan_initialization,
)


class NonFiniteWeights(RuntimeError):
    """A parameter or buffer holds NaN or infinity right after setup: training would run on garbage."""


@dataclass
class WeightsPlan:
    built_empty: bool  # parameters on the meta device: materialized after parallelizing
    source: WeightsSource | None = None
    weights: WeightMap | None = None
    init: InitPlan | None = None

    @property
    def fills(self) -> bool:
        return self.built_empty or self.source is not None


def check_pretrained(pretrained: str | os.PathLike | None) -> Path | None:
    """``pretrained`` as a path that exists, checked when the strategy is built (before any process starts)."""
    if pretrained is None:
        return None
    if not isinstance(pretrained, (str, os.PathLike)):
        raise TypeError(f"`pretrained` must be a path (str or os.PathLike), got {type(pretrained).__name__}.")
    path = Path(pretrained).expanduser()
    if not path.exists():
        raise FileNotFoundError(
            f"pretrained={str(pretrained)!r}: no such file or directory (a Hugging Face model directory, a torch or"
            " Lightning checkpoint file, or a sharded checkpoint directory)."
        )
    if path.is_dir() and any(path.glob("*.safetensors")):
        require("safetensors", f"pretrained={str(pretrained)!r} (a Hugging Face model directory)")
    return path


def plan_weights(
    module: nn.Module, pretrained: str | Path | None, strict: bool, rng_state: torch.Tensor | None
) -> WeightsPlan:
    """Check ``pretrained`` against the whole ``module`` and plan what its initializers must fill; reads headers
    only, the same on every rank (so every rank raises alike, before any collective)."""
    plan = WeightsPlan(built_empty=has_meta_tensors(module))
    if pretrained is not None:
        plan.source = open_weights(pretrained)
        plan.weights = map_weights(module, plan.source, strict)
        rank_zero_info(f"pretrained={str(pretrained)!r} ({plan.source.kind}): {plan.weights.describe()}.")
    if plan.built_empty:
        loaded = plan.weights.loaded() if plan.weights is not None else set()
        plan.init = plan_initialization(module, loaded, rng_state)
    return plan


def fill_weights(module: nn.Module, plan: WeightsPlan, device: torch.device) -> None:
    """After parallelizing: memory for each rank's slices, the planned initializers, the checkpoint read. Collective
    where a checkpoint is read or weights are checked."""
    if plan.built_empty:
        materialize(module, device)
    if plan.init is not None:
        initialize_missing(plan.init)
    if plan.source is not None and plan.weights is not None:
        load_weights(module, plan.source, plan.weights)
    if plan.fills:
        check_finite(module)


@torch.no_grad()
def check_finite(module: nn.Module) -> None:
    """Refuse, on every rank alike, a module holding NaN or infinity (an uninitialized tensor, a broken file)."""
    bad = []
    for name, tensor in [*module.named_parameters(), *module.named_buffers()]:
        local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
        if local.is_floating_point() and not local.is_meta and not torch.isfinite(local).all():
            bad.append(name)
    found: list[Any] = [bad]
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        found = [None] * dist.get_world_size()
        dist.all_gather_object(found, bad)
    names = list(dict.fromkeys(name for part in found for name in part or []))
    if names:
        raise NonFiniteWeights(
            f"{len(names)} parameters or buffers hold NaN or infinity right after setup: {', '.join(names[:8])}"
            f"{' ...' if len(names) > 8 else ''}. The checkpoint holds such values, or the tensors were never"
            " initialized; training on them would give a NaN loss."
        )


def check_first_loss(output: object) -> None:
    """The first training loss after the strategy filled the weights is a number, or the run stops here."""
    loss = output.get("loss") if isinstance(output, dict) else output
    if isinstance(loss, torch.Tensor) and loss.numel() == 1 and not torch.isfinite(loss.detach()).all():
        raise NonFiniteWeights(
            f"The first training loss is {loss.item()} right after setup filled the weights (a checkpoint or the"
            " modules' initializers): a tensor the model reads is garbage (for example a buffer computed outside"
            " `__init__` and not in the checkpoint) or the checkpoint does not belong to this model."
        )


class WeightsHooks(ParallelStrategy):
    """Mixed into ``HybridStrategy``, which sets the pretrained path and strictness: the module built with its
    parameters on the meta device (``tensor_init_context``), its weights planned before parallelizing and filled
    after (``setup``)."""

    _pretrained: Path | None
    _pretrained_strict: bool
    _init_rng_state: torch.Tensor | None  # the random state parameters built on the meta device were made in
    _first_loss_checked: bool | None  # None: nothing to check; False: check the next training step's loss

    @contextmanager
    @override
    def tensor_init_context(self, empty_init: bool | None = None) -> Generator[None, None, None]:
        # Parameters built on the meta device (buffers as usual) are materialized in `setup()` after parallelizing,
        # each rank holding only its slices; with `pretrained`, that is the default.
        on_meta = empty_init if empty_init is not None else self._pretrained is not None
        if on_meta:
            self._init_rng_state = torch.get_rng_state()  # the initializers of what no checkpoint fills start here
        with parameters_on_meta() if on_meta else nullcontext(), self.precision_plugin.tensor_init_context():
            yield

    def _plan_weights(self, module: nn.Module) -> WeightsPlan:
        return plan_weights(module, self._pretrained, self._pretrained_strict, self._init_rng_state)

    def _fill_weights(self, module: nn.Module, plan: WeightsPlan) -> None:
        fill_weights(module, plan, self.root_device)
        self._first_loss_checked = False if plan.fills else None
