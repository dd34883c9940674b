"""Model and optimizer states of a DeepSpeed engine in the checkpoint format of the torch backend.

DeepSpeed keeps fp32 master weights and optimizer states as flat partitions of its own. A save writes them under
the same plain FQN keys as the torch backend (``state_dict.<fqn>``, ``optimizer_states.<i>.state.<fqn>.<name>``,
``...param_groups.<fqn>.<hparam>``), each rank only what it owns: its piece of each parameter's flat range, handed
to DCP as the N-d boxes that range covers (``flat_fragments``), views of DeepSpeed's own partitions. Nothing is
gathered, so a save holds no more per rank than the rank's partitions (plus DCP's per-chunk copy while writing),
and sends nothing but DCP's plan. A load reads the same way, whatever layout saved the checkpoint: each rank its
pieces of the partitioned states (ZeRO-3: into a partition-sized buffer handed over with ``safe_set_local_*``;
ZeRO-1/2: straight into the optimizer states' fragments), ZeRO-1/2's fp32 parameters whole straight into the module
(which each rank holds whole), then into the fp32 master fragment. Only what is neither (buffers, frozen ZeRO-1/2
parameters, low-precision ZeRO-1/2 modules, scalars) is read whole. A DeepSpeed run thus resumes under the torch
backend, any layout, and the other way round, and ``lightning-mgpu inspect/consolidate`` read it like any other
checkpoint.

Where whole values are needed (the plain module given back after ``fit``, ``full_model_state_dict``) they are
gathered per parameter with DeepSpeed's ``safe_get_full_*`` (:meth:`DeepSpeedStates.full_model_state`).

An object of :class:`DeepSpeedStates` stands in for the ``states`` module in ``Checkpointer`` (same functions).
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.storage import StorageReader
from torch.optim import Optimizer

from lightning_mgpu._compat.deepspeed import fragment_mapping, has_fragment_mapping, relink_optimizer_states
from lightning_mgpu.checkpoint import states
from lightning_mgpu.checkpoint.flat_fragments import FlatFragment, FragmentLoadPlanner
from lightning_mgpu.checkpoint.format import MODEL_KEY, OPTIMIZER_KEY, STATE_PREFIX, CheckpointError

if TYPE_CHECKING:
    from deepspeed import DeepSpeedEngine
    from torch.distributed.checkpoint.metadata import STORAGE_TYPES as StorageMeta

_V = TypeVar("_V")
_GROUPS = "param_groups."
# Where DeepSpeed's optimizers keep the flat fp32 partitions the user's optimizer steps: ZeRO-1/2, ZeRO-3, bf16 at 0.
_FP32_PARTITIONS = ("single_partition_of_fp32_groups", "fp32_partitioned_groups_flat", "fp32_groups_flat_partition")


def _partitioned(param: nn.Parameter) -> bool:
    """Whether DeepSpeed holds this parameter's fp32 master (and optimizer states) in its flat partitions.

    Under ZeRO-1/2 a parameter outside this rank's partition has ``_hp_mapping = None``: it is still DeepSpeed's,
    and every rank joins the collectives that gather it."""
    return hasattr(param, "ds_id") or has_fragment_mapping(param)


def _full_param(param: nn.Parameter) -> torch.Tensor:
    """The whole fp32 master value (every rank together), or the module's own tensor where DeepSpeed has none."""
    from deepspeed.utils import safe_get_full_fp32_param

    full = safe_get_full_fp32_param(param) if param.requires_grad else None
    if full is None and hasattr(param, "ds_id"):  # a frozen ZeRO-3 parameter: gather the module's copy
        from deepspeed.zero import GatheredParameters

        with GatheredParameters([param]):
            full = param.data.clone()
    if full is None:
        full = param.detach()
    return full.detach().reshape(_shape(param)).clone()


def _local_fragment(param: Any, zero: Any, key: str | None = None) -> FlatFragment | torch.Tensor:
    """This rank's piece of a parameter's fp32 master (``key=None``) or of its optimizer state ``key``: views of
    DeepSpeed's flat partitions, as the elements of the whole tensor they hold (none, on a rank that holds none)."""
    shape = tuple(_shape(param))
    if math.prod(shape) == 0:
        return torch.empty(shape)  # nothing to own: every rank writes the empty tensor (DCP keeps one)
    if hasattr(param, "ds_id"):  # ZeRO-3: rank r holds elements [r * n, (r + 1) * n) of the flat parameter
        from deepspeed.utils import safe_get_local_fp32_param, safe_get_local_optimizer_state

        if not param.requires_grad:
            data = param.ds_tensor if key is None else torch.empty(0)  # frozen: the module's copy, no state
        elif key is None:
            data = safe_get_local_fp32_param(param)
        else:
            data = safe_get_local_optimizer_state(param, key)
        if getattr(zero, "swap_optimizer", False):
            data = data.clone()  # NVMe offload: the view's swap buffer is handed back after the call
        size = param.partition_numel()
        start = dist.get_rank(param.ds_process_group) * size
        owned = max(0, min(size, math.prod(shape) - start))
        return FlatFragment(shape, data.reshape(-1)[:owned], start)
    mapping = fragment_mapping(param)  # ZeRO-1/2, bf16: the fragment of this rank's partition, if any
    if mapping is None:
        return FlatFragment(shape, torch.empty(0), 0)
    data = mapping.hp_fragment if key is None else mapping.get_optim_state_fragment(key)
    return FlatFragment(shape, data, mapping.lp_fragment_address.start)


def _shape(param: Any) -> torch.Size:  # a DeepSpeed-partitioned parameter carries its full shape in ds_shape
    return param.ds_shape if hasattr(param, "ds_id") else param.shape


def _is_scalar(value: object) -> bool:
    return not torch.is_tensor(value) or value.dim() == 0


class EngineRunner(Protocol):
    """What is read of the runner that built the engine (``engine.DeepSpeedEngineRunner``), here
    and by ``release``: a protocol, so the states do not import the engine."""

    engine: Any  # a DeepSpeedEngine, None once released (read where `_released` says it is there)
    optimizer: Optimizer | None
    param_groups: list[list[nn.Parameter]]


class DeepSpeedStates:
    """``Checkpointer``'s state access for a model trained through :class:`DeepSpeedEngineRunner`."""

    def __init__(self, runner: EngineRunner) -> None:
        self.runner = runner

    @property
    def _released(self) -> bool:
        """After ``fit`` the engine is gone and the module and optimizer are plain torch objects again
        (``release``): a save then reads them like the torch backend's unsharded ones."""
        return self.runner.engine is None

    # ------------------------------------------------------------------------------------------------------ save
    def model_state(self, model: nn.Module) -> dict[str, torch.Tensor] | dict[str, torch.Tensor | FlatFragment]:
        """Every entry of ``model.state_dict()``, parameters as this rank's pieces of their fp32 masters."""
        if self._released:
            return states.model_state(model)
        zero = self.runner.engine.optimizer
        return self._model_entries(model, lambda param: _local_fragment(param, zero))

    def full_model_state(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """Every entry of ``model.state_dict()``, parameters as whole fp32 masters. Collective."""
        if self._released:
            return states.model_state(model)
        return self._model_entries(model, _full_param)

    def _model_entries(self, model: nn.Module, value_of: Callable[[nn.Parameter], _V]) -> dict[str, torch.Tensor | _V]:
        params = dict(model.named_parameters(remove_duplicate=False))
        values: dict[nn.Parameter, _V] = {}
        state: dict[str, torch.Tensor | _V] = {}
        for key, value in model.state_dict().items():
            param = params.get(key)
            if param is None:
                state[key] = value.detach()
                continue
            if param not in values:
                values[param] = value_of(param)
            state[key] = values[param]
        return state

    def optimizer_state(self, model: nn.Module, optimizer: Optimizer, initialize: bool = False) -> dict[str, object]:
        """The torch backend's flattened optimizer state, per parameter FQN, as this rank's pieces."""
        zero = None if self._released else self.runner.engine.optimizer
        return self._optimizer_entries(model, optimizer, initialize, lambda p, key: _local_fragment(p, zero, key))

    def full_optimizer_state(self, model: nn.Module, optimizer: Optimizer) -> dict[str, object]:
        """The torch backend's flattened optimizer state, per parameter FQN, whole. Collective."""
        from deepspeed.utils import safe_get_full_optimizer_state

        return self._optimizer_entries(
            model, optimizer, False, lambda p, key: safe_get_full_optimizer_state(p, key).reshape(_shape(p))
        )

    def _optimizer_entries(
        self,
        model: nn.Module,
        optimizer: Optimizer,
        initialize: bool,
        value_of: Callable[[nn.Parameter, str], FlatFragment | torch.Tensor],
    ) -> dict[str, object]:
        if self._released:
            return states.optimizer_state(model, optimizer, initialize)
        _relink_optimizer_states(self.runner.engine)

        names = self._fqns(model)
        tensor_keys, scalars = self._state_layout(optimizer)
        flat: dict[str, object] = {}
        for group, params in zip(optimizer.param_groups, self.runner.param_groups):
            hparams = {k: v for k, v in group.items() if k != "params"}
            for param in params:
                fqn = names[param]
                flat.update({f"{_GROUPS}{fqn}.{name}": value for name, value in hparams.items()})
                if _partitioned(param):
                    if not tensor_keys:
                        continue
                    for key in tensor_keys:
                        flat[f"{STATE_PREFIX}{fqn}.{key}"] = value_of(param, key)
                    flat.update({f"{STATE_PREFIX}{fqn}.{key}": value for key, value in scalars.items()})
                else:
                    own = optimizer.state.get(param, {})
                    flat.update({f"{STATE_PREFIX}{fqn}.{key}": value for key, value in own.items()})
        return flat

    def group_fqns(self, model: nn.Module, optimizer: Optimizer, flat_state: Mapping[str, object]) -> list[list[str]]:
        if self._released:
            return states.group_fqns(model, optimizer, flat_state)
        names = self._fqns(model)
        return [[names[param] for param in params] for params in self.runner.param_groups]

    def full_model_state_dict(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """The whole model on CPU on global rank 0 (``{}`` elsewhere). Collective."""
        state = {key: value.cpu() for key, value in self.full_model_state(model).items()}
        return state if dist.get_rank() == 0 else {}

    # ------------------------------------------------------------------------------------------------------ load
    def load_states(
        self,
        reader: StorageReader,
        model: nn.Module,
        optimizers: list[Optimizer],
        strict: bool,
        where: str,
        checkpoint_id: str | os.PathLike | None = None,
    ) -> None:
        """Read what any layout saved into DeepSpeed's partitions, each rank its own pieces. Collective."""
        index = reader.read_metadata().state_dict_metadata
        params = dict(model.named_parameters(remove_duplicate=False))
        template = {
            key: torch.empty(_shape(params[key]), dtype=torch.float32) if key in params else value
            for key, value in model.state_dict().items()
        }
        states.check_model_fits(index, template, strict, where)
        wanted = [f"{MODEL_KEY}.{key}" for key in template]
        for i in range(len(optimizers)):
            prefix = f"{OPTIMIZER_KEY}.{i}."
            found = [key for key in index if key.startswith(prefix)]
            if not found:
                raise CheckpointError(
                    f"{where} has no state for optimizer {i} (it was saved with `save_weights_only=True` or with"
                    " fewer optimizers): it can initialize weights but not resume training."
                )
            wanted += found
        zero = self.runner.engine.optimizer
        pieces = self._read_piecewise(model, len(optimizers), index)
        names = self._fqns(model)
        tied = {f"{MODEL_KEY}.{name}" for name, param in params.items() if _piecewise(param) and names[param] != name}
        request = {key: _empty(index[key]) for key in wanted if key in index and key not in pieces and key not in tied}
        _read(request, reader, checkpoint_id, where)
        self._load_model(model, params, request)
        for i, optimizer in enumerate(optimizers):
            prefix = f"{OPTIMIZER_KEY}.{i}."
            tensors = {key[len(prefix) :] for key in pieces if key.startswith(prefix)}
            self._load_optimizer(model, optimizer, _strip(request, prefix), tensors)
        # The pieces, once the optimizer states they go into exist: straight into DeepSpeed's partitions.
        _relink_optimizer_states(self.runner.engine)
        targets = {key: _piece(param, zero, name) for key, (param, name) in pieces.items()}
        _read({key: target for key, (target, _) in targets.items()}, reader, checkpoint_id, where)
        for _, finish in targets.values():
            finish()
        _refresh_zero3_partitions(self.runner.engine)

    def _read_piecewise(
        self, model: nn.Module, optimizers: int, index: Mapping[str, StorageMeta]
    ) -> dict[str, tuple[nn.Parameter, str | None]]:
        """The checkpoint keys each rank reads only its own piece of, and into what: ``(parameter, None)`` for its
        fp32 master, ``(parameter, state name)`` for an optimizer state: every state DeepSpeed partitions, ZeRO-3's
        parameters, and ZeRO-1/2's fp32 ones whole (each rank holds the module whole) straight into the module.
        A tied parameter's second name is not read at all."""
        pieces: dict[str, tuple[nn.Parameter, str | None]] = {}
        names = self._fqns(model)
        for param, fqn in names.items():
            if _piecewise(param) and f"{MODEL_KEY}.{fqn}" in index:
                pieces[f"{MODEL_KEY}.{fqn}"] = (param, None)
            if not (_partitioned(param) and param.requires_grad):
                continue
            for i in range(optimizers):
                prefix = f"{OPTIMIZER_KEY}.{i}.{STATE_PREFIX}{fqn}."
                for key, entry in index.items():
                    rest = key[len(prefix) :]
                    if key.startswith(prefix) and "." not in rest and getattr(entry, "size", None) == _shape(param):
                        pieces[key] = (param, rest)
        return pieces

    def _load_model(self, model: nn.Module, params: dict[str, nn.Parameter], request: dict[str, Any]) -> None:
        from deepspeed.utils import safe_set_full_fp32_param

        buffers = dict(model.named_buffers())
        done: set[nn.Parameter] = set()
        for key, value in request.items():
            if not key.startswith(MODEL_KEY + "."):
                continue
            name = key[len(MODEL_KEY) + 1 :]
            if name in buffers:
                buffers[name].data.copy_(value)
            param = params.get(name)
            if param is None or param in done:
                continue
            done.add(param)
            if _partitioned(param) and param.requires_grad:
                safe_set_full_fp32_param(param, value.to(torch.float32))
            if hasattr(param, "ds_id"):
                continue  # the low-precision partitions are refreshed from the fp32 ones below
            param.data.copy_(value.reshape(param.shape))
        _refresh_zero3_partitions(self.runner.engine)

    def _load_optimizer(self, model: nn.Module, optimizer: Optimizer, flat: dict[str, Any], tensors: set[str]) -> None:
        """Hyperparameters, scalar states and the states of parameters DeepSpeed does not partition, from ``flat``;
        the partitioned parameters' tensor states (``tensors``, read piecewise after) are created empty."""
        from deepspeed.utils import safe_set_full_optimizer_state

        names = self._fqns(model)
        sample = next((k for k in [*flat, *sorted(tensors)] if k.startswith(STATE_PREFIX)), None)
        if sample is not None:
            fqn = states._split_state_key(sample[len(STATE_PREFIX) :], set(names.values()))[0]
            prefix = f"{STATE_PREFIX}{fqn}."
            placeholders = {key: torch.empty(1) for key in _strip(dict.fromkeys(tensors), prefix)}
            self._create_missing_states(optimizer, _strip(flat, prefix) | placeholders)
        tensor_keys, scalars = self._state_layout(optimizer)
        for group, params in zip(optimizer.param_groups, self.runner.param_groups):
            saved = _strip(flat, f"{_GROUPS}{names[params[0]]}.") if params else {}  # the group's hyperparameters
            group.update({name: value for name, value in saved.items() if name != "params"})
            for param in params:
                prefix = f"{STATE_PREFIX}{names[param]}."
                entries = _strip(flat, prefix)
                if not _partitioned(param):
                    if entries:
                        optimizer.state[param] = entries
                    continue
                for key, value in entries.items():
                    if key in tensor_keys:
                        safe_set_full_optimizer_state(param, value.to(torch.float32), key)
                    elif key in scalars:
                        for state in optimizer.state.values():
                            state[key] = value.clone() if torch.is_tensor(value) else value

    def _create_missing_states(self, optimizer: Optimizer, example: Mapping[str, object]) -> None:
        """Give DeepSpeed's flat fp32 partitions the states a saved parameter has (``example``), before they are
        filled: ZeRO-3 (and a fresh optimizer generally) creates them only at its first step."""
        zero = getattr(self.runner.engine, "optimizer", None)
        created = False
        for name in _FP32_PARTITIONS:
            for partition in getattr(zero, name, None) or []:
                if partition is None or optimizer.state.get(partition):
                    continue
                optimizer.state[partition] = {
                    key: value.clone()
                    if _is_scalar(value) and torch.is_tensor(value)
                    else value
                    if _is_scalar(value)
                    else torch.zeros_like(partition)
                    for key, value in example.items()
                }
                created = True
        if created:
            relink_optimizer_states(zero)  # ZeRO-1/2 and bf16: point each parameter at its fragments

    # --------------------------------------------------------------------------------------------------- helpers
    def _fqns(self, model: nn.Module) -> dict[nn.Parameter, str]:
        names: dict[nn.Parameter, str] = {}
        for name, param in model.named_parameters(remove_duplicate=False):
            names.setdefault(param, name)
        return names

    def _state_layout(self, optimizer: Optimizer) -> tuple[list[str], dict[str, object]]:
        """The per-element state names (``exp_avg``, ...) of DeepSpeed's flat partitions, and the scalar states
        (``step``), which every partition of a step shares."""
        flats = [state for key, state in optimizer.state.items() if not _is_module_param(key, self.runner)]
        tensor_keys = sorted({k for state in flats for k, v in state.items() if not _is_scalar(v)})
        scalars = {k: v for state in flats for k, v in state.items() if _is_scalar(v)}
        return tensor_keys, scalars


def _piecewise(param: Any) -> bool:
    """Whether a load reads this parameter's own piece only: ZeRO-3's, or ZeRO-1/2's fp32 trainable ones (whole
    into the module, then into the rank's fp32 master fragment)."""
    if hasattr(param, "ds_id"):
        return True
    return has_fragment_mapping(param) and param.requires_grad and param.dtype == torch.float32


def _piece(param: Any, zero: Any, name: str | None) -> tuple[FlatFragment | torch.Tensor, Callable[[], object]]:
    """What DCP reads a piecewise key into, and what puts it in place after.

    ZeRO-3: a buffer of the rank's (padded) partition, handed over with DeepSpeed's ``safe_set_local_*`` (which
    also swap NVMe-offloaded states); a frozen parameter's goes into its partition. ZeRO-1/2: the module's whole
    parameter (then its fp32 master fragment from it, ``update_hp``) or the state's fragment, a view."""
    from deepspeed.utils import safe_set_local_fp32_param, safe_set_local_optimizer_state

    if hasattr(param, "ds_id"):
        shape, size = tuple(_shape(param)), param.partition_numel()
        start = dist.get_rank(param.ds_process_group) * size
        owned = max(0, min(size, math.prod(shape) - start))
        buffer = torch.zeros(size, dtype=torch.float32)
        if not param.requires_grad:
            finish = lambda: param.ds_tensor.data.copy_(buffer)
        elif name is None:
            finish = lambda: safe_set_local_fp32_param(param, buffer)
        else:
            finish = lambda: safe_set_local_optimizer_state(param, buffer, name)
        return FlatFragment(shape, buffer[:owned], start), finish
    if name is None:
        mapping = fragment_mapping(param)
        return param.data, (mapping.update_hp if mapping is not None else lambda: None)
    return _local_fragment(param, zero, name), lambda: None


def _read(request: dict[str, Any], reader: StorageReader, checkpoint_id: str | os.PathLike | None, where: str) -> None:
    try:
        dcp.load(request, checkpoint_id=checkpoint_id, storage_reader=reader, planner=FragmentLoadPlanner())
    except Exception as error:
        raise CheckpointError(f"Loading {where} failed: {error}") from error


def _strip(entries: Mapping[str, _V], prefix: str) -> dict[str, _V]:
    """The entries under ``prefix``, keyed without it."""
    return {key[len(prefix) :]: value for key, value in entries.items() if key.startswith(prefix)}


def _is_module_param(tensor: torch.Tensor, runner: EngineRunner) -> bool:
    return any(tensor is param for params in runner.param_groups for param in params)


def _empty(entry: StorageMeta) -> torch.Tensor | None:
    if isinstance(entry, TensorStorageMetadata):
        return torch.empty(entry.size, dtype=entry.properties.dtype)
    return None  # bytes: DCP replaces the placeholder with the saved object


def _relink_optimizer_states(engine: DeepSpeedEngine | None) -> None:
    """Point every parameter's fragment at its group's current optimizer states.

    DeepSpeed's ZeRO-1/2 (and bf16) optimizer links the fragments once, right after stepping its *first* param
    group (deepspeed 0.19.8, ``stage_1_and_2._optimizer_step``): the other groups' states do not exist yet, so their
    parameters' fragments stay without ``exp_avg`` and ``safe_get_full_optimizer_state`` fails on one rank (the
    others then wait in its all-reduce). Linking again is local and cheap (views)."""
    relink_optimizer_states(getattr(engine, "optimizer", None))


def _refresh_zero3_partitions(engine: DeepSpeedEngine | None) -> None:
    """ZeRO-3 copies its fp32 partitions into the module's partitions after each step; do the same after a load."""
    optimizer = getattr(engine, "optimizer", None)
    low = getattr(optimizer, "fp16_partitioned_groups_flat", None)
    high = getattr(optimizer, "fp32_partitioned_groups_flat", None)
    if low is None or high is None:
        return
    with torch.no_grad():
        for lp, hp in zip(low, high):
            if lp is not None and hp is not None:
                lp.copy_(hp)
