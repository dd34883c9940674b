"""Model, optimizer and RNG states of the live objects, keyed by plain FQNs whatever the layout.

The optimizer state is DCP's flattened form (``state.<fqn>.<name>``, ``param_groups.<fqn>.<hparam>``): every
entry names its parameter, so ranks holding different parameters (ZeRO-1 owners, pipeline stages) save and load
their own parts and any other layout can reassemble them.
"""

from __future__ import annotations

import functools
import operator
import os
import random
from collections import defaultdict
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, Protocol, TypeVar, cast

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.checkpoint.storage import StorageReader
from torch.optim import Optimizer

from lightning_mgpu.checkpoint.format import MODEL_KEY, OPTIMIZER_KEY, STATE_PREFIX, CheckpointError

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup
    from torch.distributed.checkpoint.metadata import STORAGE_TYPES as StorageMeta

_V = TypeVar("_V")
_FLAT = StateDictOptions(flatten_optimizer_state_dict=True)
_GROUPS = "param_groups."


class StateAccess(Protocol):
    """How the checkpointer reads and writes the live states: this module itself, or an object with the same
    functions for an engine that keeps its own partitions (``backends.deepspeed.DeepSpeedStates``)."""

    def model_state(self, model: nn.Module) -> Mapping[str, object]: ...

    def optimizer_state(
        self, model: nn.Module, optimizer: Optimizer, initialize: bool = False
    ) -> Mapping[str, object]: ...

    def group_fqns(
        self, model: nn.Module, optimizer: Optimizer, flat_state: Mapping[str, object]
    ) -> list[list[str]]: ...

    def full_model_state_dict(self, model: nn.Module) -> dict[str, torch.Tensor]: ...

    def load_states(
        self,
        reader: StorageReader,
        model: nn.Module,
        optimizers: list[Optimizer],
        strict: bool,
        where: str,
        checkpoint_id: str | os.PathLike | None = None,
    ) -> None: ...


def full_model_state_dict(
    model: nn.Module, pp_group: ProcessGroup | None = None, everywhere: bool = False
) -> dict[str, torch.Tensor]:
    """The unsharded ``model.state_dict()`` on CPU, on global rank 0 (other ranks get ``{}``). Collective.

    Keys are the model's own: its state-dict hooks run, as when plain Lightning saves it (torch's
    ``get_model_state_dict`` cannot follow hooks that rename entries, e.g. a fused q|k|v saved as ``wq``/``wk``/``wv``).
    With pipeline stages (``pp_group``), every rank first gathers its stage's data/tensor-parallel shards, then
    global rank 0 collects the stages, which hold disjoint entries. ``everywhere``: every rank gets the whole state
    (on the parameters' devices where no pipeline splits the model).
    """
    return _whole(model.state_dict(), pp_group, everywhere)


def full_named_tensors(model: nn.Module, pp_group: ProcessGroup | None = None) -> dict[str, torch.Tensor]:
    """Every parameter's and buffer's whole value on every rank, keyed by ``named_parameters``/``named_buffers``
    names, every name of a tied one: what puts the plain module's own tensors back, whatever its state-dict hooks
    call them. Collective.

    A name that is a parameter on one pipeline rank and a buffer on another (a stage that does not own a parameter
    held directly by a shared module keeps a buffer copy) takes the parameter's value.
    """
    buffers = _whole(dict(model.named_buffers(remove_duplicate=False)), pp_group, everywhere=True)
    parameters = _whole(dict(model.named_parameters(remove_duplicate=False)), pp_group, everywhere=True)
    return {**buffers, **parameters}


@torch.no_grad()
def _whole(
    state: Mapping[str, torch.Tensor], pp_group: ProcessGroup | None, everywhere: bool
) -> dict[str, torch.Tensor]:
    """``state`` with every DTensor gathered (in the same key order on the ranks of its mesh), merged over
    ``pp_group``; on global rank 0 only unless ``everywhere``, on CPU unless ``everywhere`` without stages."""
    from torch.distributed.tensor import DTensor

    offload = pp_group is not None or not everywhere
    whole: dict[str, torch.Tensor] = {}
    for key, value in state.items():
        value = value.full_tensor() if isinstance(value, DTensor) else value
        whole[key] = value.detach().cpu() if offload and isinstance(value, torch.Tensor) else value
    if pp_group is None:
        return whole if everywhere or dist.get_rank() == 0 else {}
    ranks = dist.get_process_group_ranks(pp_group)
    if everywhere:
        gathered: list | None = [None] * len(ranks)
        dist.all_gather_object(gathered, whole, group=pp_group)
    else:
        gathered = [None] * len(ranks) if dist.get_rank() == ranks[0] else None
        dist.gather_object(whole, gathered, dst=ranks[0], group=pp_group)
        if dist.get_rank() != 0:
            return {}
    return {key: value for part in gathered or [] for key, value in part.items()}  # tensors, as `state` holds


def model_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """``model.state_dict()`` (the model's hooks applied, values as the layout holds them) for DCP to save or fill."""
    return describable(model.state_dict())


def describable(state: Mapping[str, _V]) -> dict[str, _V]:
    """DCP cannot describe a fused projection's tensor-parallel ``_StridedShard``: replicate those over ``tp``.

    Only the fused q|k|v weights are concerned (a small part of the model); every other placement is kept.
    """
    from torch.distributed.tensor import DTensor, Replicate

    from lightning_mgpu._compat.dtensor import is_strided_shard
    from lightning_mgpu.layout import TP_AXIS

    def convert(value: _V) -> _V:
        if not isinstance(value, DTensor):
            return value
        names = value.device_mesh.mesh_dim_names or ()
        placements = [
            Replicate() if is_strided_shard(p) and i < len(names) and names[i] == TP_AXIS else p
            for i, p in enumerate(value.placements)
        ]
        # A DTensor stays one: what `state` holds.
        return value if list(value.placements) == placements else cast(_V, value.redistribute(placements=placements))

    return {key: convert(value) for key, value in state.items()}


def _restore_state_placements(optimizer: Optimizer) -> None:
    """Loaded optimizer states take their parameter's layout again (see :func:`describable`)."""
    from torch.distributed.tensor import DTensor

    for param, state in optimizer.state.items():
        for name, value in state.items():
            if isinstance(value, DTensor) and isinstance(param, DTensor) and value.shape == param.shape:
                if value.placements != param.placements:
                    state[name] = value.redistribute(placements=param.placements)


@contextmanager
def _no_implicit_init(optimizer: Optimizer) -> Iterator[None]:
    """Keep DCP from initializing an empty optimizer state with a zero-lr step.

    DCP does that in ``get_optimizer_state_dict`` and again in ``set_optimizer_state_dict`` whenever the state is
    empty and no gradient exists. That step would change the run (Adam's step count), and under ZeRO-1 it is a
    collective issued by the ranks that hold no state only (a hang). A zero gradient on one parameter makes DCP
    skip it.
    """
    params = [p for group in optimizer.param_groups for p in group["params"]]
    sentinel = None
    if not optimizer.state and params and all(p.grad is None for p in params):
        sentinel = params[0]
        sentinel.grad = torch.zeros_like(sentinel)
    try:
        yield
    finally:
        if sentinel is not None:
            sentinel.grad = None


def optimizer_state(model: nn.Module, optimizer: Optimizer, initialize: bool = False) -> dict[str, object]:
    """The optimizer's flattened state; with ``initialize`` (every rank together, on fresh optimizers), states
    are created first, to be loaded into."""
    if initialize:
        return describable(get_optimizer_state_dict(model, optimizer, options=_FLAT))
    with _no_implicit_init(optimizer):
        return describable(get_optimizer_state_dict(model, optimizer, options=_FLAT))


def _fqns_of(model: nn.Module) -> dict[nn.Parameter, list[str]]:
    from lightning_mgpu._compat.dcp import parameter_fqns

    names: dict[nn.Parameter, list[str]] = defaultdict(list)
    for name, param in model.named_parameters(remove_duplicate=False):
        names[param].extend(sorted(parameter_fqns(model, name)))
    return names


def group_fqns(model: nn.Module, optimizer: Optimizer, flat_state: Mapping[str, object]) -> list[list[str]]:
    """The FQN of every parameter of every param group, in the optimizer's order, as named in ``flat_state``."""
    present = {key[len(_GROUPS) :].rsplit(".", 1)[0] for key in flat_state if key.startswith(_GROUPS)}
    names = _fqns_of(model)
    groups = []
    for group in optimizer.param_groups:
        fqns = []
        for param in group["params"]:
            candidates = [n for n in names.get(param, []) if n in present] or names.get(param, [])
            if not candidates:
                raise CheckpointError("An optimizer holds a parameter that is not part of the LightningModule.")
            fqns.append(candidates[0])
        groups.append(fqns)
    return groups


def merge_group_fqns(per_rank: list[list[list[list[str]]]]) -> list[list[list[str]]]:
    """Union over ranks (in rank order, so pipeline stages in order) of each optimizer's param groups."""
    merged: list[list[list[str]]] = []
    for rank_groups in per_rank:
        for i, groups in enumerate(rank_groups):
            if i == len(merged):
                merged.append([[] for _ in groups])
            for j, fqns in enumerate(groups):
                seen = set(merged[i][j])
                merged[i][j].extend(f for f in fqns if f not in seen)
    return merged


# --------------------------------------------------------------------------------------- flat <-> torch's format
def _split_state_key(rest: str, fqns: set[str]) -> tuple[str, list[str]]:
    parts = rest.split(".")
    for cut in range(len(parts) - 1, 0, -1):
        fqn = ".".join(parts[:cut])
        if fqn in fqns:
            return fqn, parts[cut:]
    raise CheckpointError(f"The optimizer state entry {rest!r} names no parameter of the checkpoint.")


def flat_to_native(flat: dict[str, Any], groups: list[list[str]]) -> dict[str, Any]:
    """DCP's flattened optimizer state to ``torch.optim.Optimizer.state_dict()``'s format (integer ids)."""
    fqns = {fqn for group in groups for fqn in group}
    hparams: dict[str, dict[str, Any]] = defaultdict(dict)
    states: dict[str, dict[str, Any]] = defaultdict(dict)
    for key, value in flat.items():
        if key.startswith(_GROUPS):
            fqn, name = key[len(_GROUPS) :].rsplit(".", 1)
            hparams[fqn][name] = value
        elif key.startswith(STATE_PREFIX):
            fqn, path = _split_state_key(key[len(STATE_PREFIX) :], fqns)
            node = states[fqn]
            for part in path[:-1]:
                node = node.setdefault(part, {})
            node[path[-1]] = value
    native: dict[str, Any] = {"state": {}, "param_groups": []}
    index = 0
    for group in groups:
        native_group = dict(hparams.get(group[0], {})) if group else {}
        native_group["params"] = []
        for fqn in group:
            native_group["params"].append(index)
            if fqn in states:
                native["state"][index] = states[fqn]
            index += 1
        native["param_groups"].append(native_group)
    return native


def native_to_flat(native: dict[str, Any], groups: list[list[str]]) -> dict[str, Any]:
    """``Optimizer.state_dict()``'s format, with the FQNs of its param groups, to DCP's flattened form."""
    if len(native["param_groups"]) != len(groups):
        raise CheckpointError(
            f"The checkpoint's optimizer has {len(native['param_groups'])} param groups, the current one {len(groups)}."
        )
    flat: dict[str, Any] = {}

    def add_state(prefix: str, value: object) -> None:
        if isinstance(value, dict):
            for name, inner in value.items():
                add_state(f"{prefix}.{name}", inner)
        else:
            flat[prefix] = value

    for group, fqns in zip(native["param_groups"], groups):
        if len(group["params"]) != len(fqns):
            raise CheckpointError(
                f"A param group of the checkpoint's optimizer has {len(group['params'])} parameters, the current"
                f" one {len(fqns)}."
            )
        for pid, fqn in zip(group["params"], fqns):
            for name, value in group.items():
                if name != "params":
                    flat[f"{_GROUPS}{fqn}.{name}"] = value
            for name, value in native["state"].get(pid, {}).items():
                add_state(f"{STATE_PREFIX}{fqn}.{name}", value)
    return flat


# ------------------------------------------------------------------------------------------------------- loading
def load_states(
    reader: StorageReader,
    model: nn.Module,
    optimizers: list[Optimizer],
    strict: bool,
    where: str,
    checkpoint_id: str | os.PathLike | None = None,
) -> None:
    """Fill ``model`` and ``optimizers`` from ``reader`` (resharding to the current layout). Collective.

    Only entries the checkpoint has are requested, so what is missing is named here instead of failing deep
    inside DCP: model entries and entries the model lacks (errors when ``strict``, see :func:`check_model_fits`),
    a whole optimizer (an error: nothing to resume), some states of a parameter (an error: corrupt), or every
    state of a parameter (fine: the parameter had none yet).
    """
    index = reader.read_metadata().state_dict_metadata
    available = set(index)
    model_sd = model_state(model)
    check_model_fits(index, model_sd, strict, where)
    missing = [k for k in model_sd if f"{MODEL_KEY}.{k}" not in available]
    request: dict[str, Any] = {MODEL_KEY: {k: v for k, v in model_sd.items() if k not in set(missing)}}
    templates, stateless = [], []
    for i, optimizer in enumerate(optimizers):
        prefix = f"{OPTIMIZER_KEY}.{i}."
        if not any(key.startswith(prefix) for key in available):
            raise CheckpointError(
                f"{where} has no state for optimizer {i} (it was saved with `save_weights_only=True` or with fewer"
                " optimizers): it can initialize weights but not resume training."
            )
        template = optimizer_state(model, optimizer, initialize=True)
        templates.append(template)
        stateless.append(_params_without_saved_state(template, available, prefix, optimizer, model, where))
        # Only what the checkpoint has; the rest (an option a newer torch added) keeps its current value.
        request.setdefault(OPTIMIZER_KEY, []).append({k: v for k, v in template.items() if prefix + k in available})
    try:
        dcp.load(request, checkpoint_id=checkpoint_id, storage_reader=reader)
    except Exception as error:
        raise CheckpointError(f"Loading {where} failed: {error}") from error
    model_sd.update(request[MODEL_KEY])
    model.load_state_dict(model_sd)  # the model's own load hooks undo what its state-dict hooks did
    for optimizer, template, loaded, without in zip(optimizers, templates, request.get(OPTIMIZER_KEY, []), stateless):
        template.update(loaded)
        with _no_implicit_init(optimizer):
            # The flattened form (options=_FLAT), which torch's annotation leaves out:
            set_optimizer_state_dict(model, optimizer, template, options=_FLAT)  # type: ignore[arg-type]
        _restore_state_placements(optimizer)
        # Parameters that had no state when saved (never stepped, or steps skipped by the loss scaler) get none.
        for param in [p for p, s in optimizer.state.items() if p in without or not s]:
            del optimizer.state[param]


def _params_without_saved_state(
    template: Mapping[str, object], available: set[str], prefix: str, optimizer: Optimizer, model: nn.Module, where: str
) -> set[nn.Parameter]:
    """The parameters the checkpoint has no optimizer state for; an error if it has only part of one's state."""
    fqns = {fqn for groups in group_fqns(model, optimizer, template) for fqn in groups}
    by_param: dict[str, list[str]] = defaultdict(list)
    for key in template:
        if key.startswith(STATE_PREFIX):
            by_param[_split_state_key(key[len(STATE_PREFIX) :], fqns)[0]].append(key)
    without = set()
    for fqn, keys in by_param.items():
        absent = [k for k in keys if prefix + k not in available]
        if absent and len(absent) < len(keys):
            raise CheckpointError(f"{where} is missing optimizer entries {some(absent)}: the checkpoint is corrupt.")
        if absent:
            without.add(fqn)
    if not without:
        return set()
    return {param for param, names in _fqns_of(model).items() if without.intersection(names)}


def check_model_fits(
    index: Mapping[str, StorageMeta], model_sd: Mapping[str, object], strict: bool, where: str
) -> None:
    """Compare the model with the checkpoint's index before reading any data, on every rank together. Collective.

    Shapes are global (a DTensor's ``shape``) on both sides, so every layout compares alike. A rank holds only
    its pipeline stage's entries: what the checkpoint has beyond the model is judged against the union of every
    rank's entries, and all ranks raise the same error if any rank finds a problem (none waits in a collective).
    Which checkpoint entries a rank holds travels as one bit per entry, not as names.
    """
    saved = {key[len(MODEL_KEY) + 1 :]: value for key, value in index.items() if key.startswith(MODEL_KEY + ".")}
    mismatched = [
        f"{key} is {list(value.shape)} in the model, {list(saved[key].size)} in the checkpoint"  # type: ignore[union-attr]
        for key, value in model_sd.items()
        # (hasattr: a tensor's entry, which has a size; mypy does not narrow on it)
        if isinstance(value, torch.Tensor) and hasattr(saved.get(key), "size") and value.shape != saved[key].size  # type: ignore[union-attr]
    ]
    missing = [key for key in model_sd if key not in saved] if strict else []
    bits = int("".join("1" if key in model_sd else "0" for key in saved) or "0", 2)  # same order on every rank
    reports = _union_over_ranks({"held": bits, "missing": missing, "mismatched": mismatched})
    union = format(functools.reduce(operator.or_, (report["held"] for report in reports)), f"0{len(saved)}b")
    missing = list(dict.fromkeys(key for report in reports for key in report["missing"]))
    mismatched = list(dict.fromkeys(line for report in reports for line in report["mismatched"]))
    held = [key for key, bit in zip(saved, union) if bit == "1"] + missing
    unexpected = [key for key, bit in zip(saved, union) if bit == "0"] if strict else []
    problems = []
    if missing:
        problems.append(
            f"it has no entry for {len(missing)} of the model's {len(held)} parameters and buffers:"
            f" {some(by_block(missing, held))}"
        )
    if unexpected:
        problems.append(
            f"it has {len(unexpected)} entries the model does not have: {some(by_block(unexpected, list(saved)))}"
        )
    if missing or unexpected:
        problems[-1] += " (set `strict_loading = False` on the LightningModule to load only the entries both have)"
    if mismatched:
        problems.append(f"shapes differ: {some(mismatched, 4)}")
    if problems:
        raise CheckpointError(f"{where} does not fit the model: {'; '.join(problems)}.")


def _union_over_ranks(report: dict[str, Any]) -> list[dict[str, Any]]:
    if not (dist.is_available() and dist.is_initialized()):
        return [report]
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, report)
    return gathered


def by_block(keys: list[str], among: list[str]) -> list[str]:
    """``model.layers.2.*`` when every entry of that numbered block (of ``among``) is listed; other keys as is."""

    def block(key: str) -> str:
        parts = key.split(".")
        cut = next((i for i, part in enumerate(parts[:-1]) if part.isdigit()), None)
        return key if cut is None else ".".join(parts[: cut + 1]) + ".*"

    sizes: defaultdict[str, int] = defaultdict(int)
    for key in among:
        sizes[block(key)] += 1
    listed: dict[str, list[str]] = defaultdict(list)
    for key in keys:
        listed[block(key)].append(key)
    shown = []
    for name, members in listed.items():
        shown += [name] if len(members) > 1 and len(members) == sizes[name] else members
    return shown


def some(keys: list[str], limit: int = 8) -> str:
    shown = ", ".join(keys[:limit])
    return shown + (f" and {len(keys) - limit} more" if len(keys) > limit else "")


# ----------------------------------------------------------------------------------------------------------- RNG
def collect_rng_states() -> dict[str, object]:
    """Torch (CPU and CUDA), Python and NumPy RNG states, in types ``torch.load(weights_only=True)`` accepts."""
    states: dict[str, object] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        states["torch.cuda"] = torch.cuda.get_rng_state_all()
    try:
        import numpy as np
    except ImportError:  # pragma: no cover
        return states
    name, keys, pos, has_gauss, cached = cast(tuple, np.random.get_state())  # legacy=True: the tuple form
    states["numpy"] = (name, torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss), float(cached))
    return states


def set_rng_states(states: dict[str, Any]) -> None:
    torch.set_rng_state(states["torch"])
    if "torch.cuda" in states and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(states["torch.cuda"])
    version, internal, gauss = states["python"]
    random.setstate((version, tuple(internal), gauss))
    if "numpy" in states:
        import numpy as np

        name, keys, pos, has_gauss, cached = states["numpy"]
        np.random.set_state((name, keys.numpy().astype(np.uint32), pos, has_gauss, cached))


def laid_out_as_live(entries: Mapping[str, Any], model: nn.Module) -> dict[str, Any]:
    """The moved model states with each whole tensor laid out as the live module's DTensor of the same name, for
    the hook that loads them into the module and into a copy laid out as it (``WeightAveraging``'s average,
    ``strategy/averaging.py``): a DTensor takes a DTensor of its placements. Each rank cuts its own shards."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    live = model.state_dict()
    if not any(isinstance(value, DTensor) for value in live.values()):
        return dict(entries)

    def laid_out(name: str, value: object) -> object:
        target = live.get(name)
        if not isinstance(target, DTensor) or not isinstance(value, torch.Tensor) or isinstance(value, DTensor):
            return value
        value = value.to(target.device)
        return distribute_tensor(value, target.device_mesh, target.placements, src_data_rank=None)

    return {
        key: {name: laid_out(name, value) for name, value in entry.items()} if isinstance(entry, Mapping) else entry
        for key, entry in entries.items()
    }
