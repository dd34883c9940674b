"""Sharded checkpoints written by Lightning's ModelParallelStrategy and FSDPStrategy, read as this package's own.

They are DCP directories with Lightning's state in ``meta.pt`` too, but name their entries otherwise: the model
``state_dict.<fqn>`` (ModelParallelStrategy) or ``model.<fqn>`` (FSDPStrategy), each optimizer's states
``optimizer_<i>.state.<fqn>.<name>`` and its hyperparameters once per parameter group
(``optimizer_<i>.param_groups.<g>.<name>``; the group's parameters, by FQN, in ``...<g>.params``).
:class:`LightningShardedReader` serves them under this package's names (``state_dict.<fqn>``,
``optimizer_states.<i>.state.<fqn>.<name>``, ``optimizer_states.<i>.param_groups.<fqn>.<name>``), so that they
load, resharded by DCP, into any layout. Nothing is copied: the renamed index points at the same bytes.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata

from lightning_mgpu.checkpoint.format import FSDP_MODEL_PREFIX, LIGHTNING_OPTIMIZER, MODEL_KEY, OPTIMIZER_KEY


class LightningShardedReader(FileSystemReader):
    """A Lightning sharded checkpoint directory, its entries under this package's names (see the module)."""

    def __init__(self, path: str | Path) -> None:
        super().__init__(path)
        self._path = Path(path)

    def read_metadata(self, *args: object, **kwargs: object) -> Metadata:
        metadata = super().read_metadata(*args, **kwargs)
        theirs = metadata.state_dict_metadata
        names = _our_names(theirs, _group_parameters(self._path, theirs))
        storage = {}
        for index, where in (metadata.storage_data or {}).items():
            for ours in names.get(index.fqn, ()):
                storage[dataclasses.replace(index, fqn=ours)] = where
        index = {ours: theirs[key] for key, renamed in names.items() for ours in renamed}
        return dataclasses.replace(metadata, state_dict_metadata=index, storage_data=storage)


def _group_parameters(path: Path, index: dict[str, Any]) -> dict[tuple[int, int], list[str]]:
    """``{(optimizer, group): [parameter FQNs]}`` from the groups' ``params`` entries (a few bytes each)."""
    import torch.distributed.checkpoint as dcp

    keys = [
        key
        for key in index
        if (m := LIGHTNING_OPTIMIZER.match(key)) and m[2] == "param_groups" and key.endswith(".params")
    ]
    if not keys:
        return {}
    state: dict[str, Any] = dict.fromkeys(keys)
    dcp.load(state, storage_reader=FileSystemReader(path), no_dist=True)
    found = {}
    for key, fqns in state.items():
        match = LIGHTNING_OPTIMIZER.match(key)
        assert match is not None
        found[(int(match[1]), int(match[3].split(".")[0]))] = list(fqns)
    return found


def _our_names(index: dict[str, Any], groups: dict[tuple[int, int], list[str]]) -> dict[str, list[str]]:
    """Each of their entries and this package's names for it (a group's hyperparameter: one per parameter)."""
    names: dict[str, list[str]] = {}
    for key in index:
        match = LIGHTNING_OPTIMIZER.match(key)
        if match is None:
            model = key[len(FSDP_MODEL_PREFIX) :] if key.startswith(FSDP_MODEL_PREFIX) else key[len(MODEL_KEY) + 1 :]
            names[key] = [f"{MODEL_KEY}.{model}"]
        elif match[2] == "state":
            names[key] = [f"{OPTIMIZER_KEY}.{match[1]}.state.{match[3]}"]
        else:
            group, _, hyperparameter = match[3].partition(".")
            if hyperparameter != "params":
                fqns = groups.get((int(match[1]), int(group)), [])
                names[key] = [f"{OPTIMIZER_KEY}.{match[1]}.param_groups.{fqn}.{hyperparameter}" for fqn in fqns]
    return names
