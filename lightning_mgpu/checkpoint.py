"""Checkpoints with torch.distributed.checkpoint (DCP), keyed by the original module FQNs.

A sharded checkpoint is a directory: DCP shards for the model and optimizer states, written by every rank, plus
``meta.pt`` with everything Lightning keeps beside them (loops, callbacks, LR schedulers, hyperparameters),
written by global rank 0. Because keys are the plain module's FQNs and DCP reshards on load, a directory saved
under one layout loads under another.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.optim import Optimizer

METADATA_FILE = "meta.pt"
_MODEL_KEY = "state_dict"
_OPTIMIZER_KEY = "optimizer_states"


def is_sharded_checkpoint(path: Path) -> bool:
    return path.is_dir() and (path / METADATA_FILE).is_file()


def full_model_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The unsharded model state on CPU, on global rank 0 (other ranks get ``{}``). Collective."""
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return get_model_state_dict(model, options=options)


def save_sharded(path: Path, model: nn.Module, optimizers: list[Optimizer], metadata: dict[str, Any]) -> None:
    """Write model and optimizer shards with DCP and the rest with ``torch.save``. Collective."""
    path.mkdir(parents=True, exist_ok=True)
    state = {
        _MODEL_KEY: get_model_state_dict(model),
        _OPTIMIZER_KEY: [get_optimizer_state_dict(model, optimizer) for optimizer in optimizers],
    }
    dcp.save(state, checkpoint_id=path)
    if not dist.is_initialized() or dist.get_rank() == 0:
        torch.save(metadata, path / METADATA_FILE)


def load_sharded(
    path: Path, model: nn.Module, optimizers: list[Optimizer], strict: bool = True, weights_only: Optional[bool] = None
) -> dict[str, Any]:
    """Load shards into ``model`` and ``optimizers`` (resharding to the current layout); return the metadata."""
    if not is_sharded_checkpoint(path):
        raise FileNotFoundError(
            f"{path} is not a lightning-mgpu sharded checkpoint: expected a directory containing {METADATA_FILE}."
        )
    state: dict[str, Any] = {_MODEL_KEY: get_model_state_dict(model)}
    if optimizers:
        state[_OPTIMIZER_KEY] = [get_optimizer_state_dict(model, optimizer) for optimizer in optimizers]
    dcp.load(state, checkpoint_id=path)
    set_model_state_dict(model, state[_MODEL_KEY], options=StateDictOptions(strict=strict))
    for optimizer, optimizer_state in zip(optimizers, state.get(_OPTIMIZER_KEY, [])):
        # DCP already refused keys missing from the checkpoint; not strict here because under ZeRO-1 a rank
        # holds (and asks for) the states of the parameters it owns only.
        set_optimizer_state_dict(model, optimizer, optimizer_state, options=StateDictOptions(strict=False))
    return torch.load(path / METADATA_FILE, map_location="cpu", weights_only=bool(weights_only))
