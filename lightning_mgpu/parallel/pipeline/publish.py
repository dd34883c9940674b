"""What the last pipeline stage computed in a step, made visible on every rank of its pipeline group.

Under pipelining the user's step runs (is replayed) on the last stage only. Its loss, the values it logs and the
torchmetrics objects it updates are sent to the other ranks of the pipeline group after every step, so Lightning on
global rank 0 (which holds the first stage) logs what a single process would:

- tensors and numbers passed to ``self.log`` are averaged over microbatches;
- torchmetrics ``Metric`` objects: after the step the last stage sends what changed in their states (tensor states
  whole, the new items of list states), so every rank's copy holds the same state and an epoch-level ``compute()``
  is right everywhere; a Metric logged ``on_step`` shows its value over the whole batch (the step's inputs are fed
  to a fresh copy), not over the last microbatch.

The steady state costs one small tensor broadcast per step, built and read on the device (one host sync per step,
none per microbatch): names, options and metrics go as pickled objects only when they change or when Metric objects
are involved.
"""

from __future__ import annotations

import copy
from collections.abc import Generator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar, cast

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from lightning_mgpu._compat.lightning import RepeatedLog
from lightning_mgpu._compat.pipelining import (
    forward_hook_functions,
    metric_progress,
    metric_states,
    set_metric_forward_value,
    set_metric_progress,
    sync_as_in_forward,
)
from lightning_mgpu._compat.tensors import tree_map

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup
    from torchmetrics import Metric

# A value `self.log` takes besides a Metric.
Logged = torch.Tensor | int | float
_Tree = TypeVar("_Tree")


@dataclass
class StepLogs:
    """What the user's step logged on the last stage during one step, across its microbatches."""

    values: list[tuple[str, Logged, dict]] = field(default_factory=list)  # tensors and numbers, one per microbatch
    metrics: dict[str, tuple[nn.Module, dict]] = field(default_factory=dict)  # name -> (Metric, log kwargs)

    def record(self, name: str, value: object, kwargs: dict) -> None:
        from torchmetrics import Metric

        if isinstance(value, Metric):
            self.metrics[name] = (value, kwargs)
        elif torch.is_tensor(value) or isinstance(value, (int, float)):
            self.values.append((name, value, kwargs))
        else:
            raise TypeError(
                f"`self.log({name!r}, ...)` needs a tensor, a number or a torchmetrics Metric,"
                f" got {type(value).__name__}."
            )

    def means(self, device: torch.device) -> dict[str, tuple[torch.Tensor, dict]]:
        """Each logged name's mean over the microbatches, as a float64 scalar on ``device`` (no host sync)."""
        grouped: dict[str, list[Logged]] = {}
        options: dict[str, dict] = {}
        for name, value, kwargs in self.values:
            grouped.setdefault(name, []).append(value)
            options[name] = kwargs
        with torch.no_grad():
            return {name: (_mean(values, device), options[name]) for name, values in grouped.items()}


def _mean(values: list[Logged], device: torch.device) -> torch.Tensor:
    """The float64 mean of logged scalars. Plain one-element tensors of one dtype (the usual case: the same code
    logged them in every microbatch) are stacked as they are, in one op, and converted to float64 once; others one
    by one (stacking mixed dtypes would promote, e.g. int64 with float32 to float32, and round large integers)."""
    plain = all(type(value) is torch.Tensor and value.numel() == 1 for value in values)
    tensors = cast(list[torch.Tensor], values)  # if `plain`
    if plain and len({value.dtype for value in tensors}) == 1:
        stacked = torch.stack([value.reshape(()) for value in tensors])
        return stacked.to(device=device, dtype=torch.float64).mean()
    return torch.stack([_as_tensor(value, device) for value in values]).mean()


def _as_tensor(value: Logged, device: torch.device) -> torch.Tensor:
    if not torch.is_tensor(value):
        return torch.tensor(float(value), dtype=torch.float64, device=device)
    if isinstance(value, DTensor):
        value = value.full_tensor()
    return value.detach().reshape(()).to(device=device, dtype=torch.float64)


class MetricRelay:
    """Tracks a module's torchmetrics objects during a step on the last stage; replays their changes elsewhere."""

    def __init__(self, module: nn.Module) -> None:
        from torchmetrics import Metric

        self.metrics = {name: m for name, m in module.named_modules() if isinstance(m, Metric)}
        self._names = {id(m): name for name, m in self.metrics.items()}
        self._counts: dict[str, int] = {}
        self._lists: dict[str, dict[str, list]] = {}
        self._forward_inputs: dict[str, list[tuple[tuple, dict]]] = {}
        self._hooks = [m.register_forward_hook(self._on_forward, with_kwargs=True) for m in self.metrics.values()]
        self._recording = False

    def name_of(self, metric: nn.Module) -> str:
        return self._names[id(metric)]

    def begin(self) -> None:
        """Before the step's replays on the last stage: remember where every metric stands."""
        self._counts = {name: metric_progress(m)[0] for name, m in self.metrics.items()}
        self._lists = {name: {s: list(getattr(m, s)) for s in _list_states(m)} for name, m in self.metrics.items()}
        self._forward_inputs = {}
        self._recording = True

    def _on_forward(self, metric: nn.Module, args: tuple, kwargs: dict, output: object) -> None:
        if self._recording:
            self._forward_inputs.setdefault(self.name_of(metric), []).append((args, kwargs))

    def end(self) -> dict[str, dict]:
        """After the replays: give metrics called on several microbatches their whole-batch forward value; return
        the changes of every metric the step updated."""
        self._recording = False
        changes = {}
        for name, metric in self.metrics.items():
            # A CompositionalMetric's forward leaves its own count alone (its children's change): it was called.
            if metric_progress(metric)[0] == self._counts.get(name) and name not in self._forward_inputs:
                continue
            inputs = self._forward_inputs.get(name, [])
            if len(inputs) > 1:
                set_metric_forward_value(metric, _whole_batch_value(metric, inputs))
            changes[name] = {
                "progress": metric_progress(metric),
                "tensors": {s: getattr(metric, s) for s in metric_states(metric) if s not in self._lists[name]},
                "lists": {s: _list_change(getattr(metric, s), before) for s, before in self._lists[name].items()},
            }
        self._forward_inputs = {}
        return changes

    def apply(self, changes: dict[str, dict], device: torch.device) -> None:
        """On the other ranks of the pipeline group: bring each changed metric to the last stage's state."""
        for name, change in changes.items():
            metric = self.metrics[name]
            for state, value in change["tensors"].items():
                setattr(metric, state, value.to(device))
            for state, (how, items) in change["lists"].items():
                items = [t.to(device) for t in items]
                setattr(metric, state, getattr(metric, state) + items if how == "extend" else items)
            count, forward_value = change["progress"]
            set_metric_progress(metric, count, _to_device(forward_value, device))

    @contextmanager
    def frozen(self) -> Generator[None, None, None]:
        """Undo whatever the block does to the metrics (torch's shape-inference trial replays a step on fake data)."""
        saved = {
            name: (*metric_progress(m), {s: _copy_state(getattr(m, s)) for s in metric_states(m)})
            for name, m in self.metrics.items()
        }
        recording, self._recording = self._recording, False
        try:
            yield
        finally:
            self._recording = recording
            for name, (count, forward_cache, states) in saved.items():
                metric = self.metrics[name]
                for state, value in states.items():
                    setattr(metric, state, value)
                set_metric_progress(metric, count, forward_cache)

    def remove(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks = []


def _copy_state(value: list | torch.Tensor) -> list | torch.Tensor:
    return list(value) if isinstance(value, list) else value.clone()


def _list_states(metric: Metric) -> list[str]:
    return [s for s, default in metric_states(metric).items() if isinstance(default, list)]


def _list_change(now: list, before: list) -> tuple[str, list]:
    """List states only grow within a step (unless reset): send the new items, or everything after a reset."""
    if len(now) >= len(before) and all(a is b for a, b in zip(now, before)):
        return "extend", now[len(before) :]
    return "replace", list(now)


def _whole_batch_value(metric: Metric, inputs: list[tuple[tuple, dict]]) -> object:
    """The value ``metric(batch)`` would have returned for the whole batch: a fresh copy fed every microbatch."""
    group = getattr(metric, "process_group", None)
    memo = {id(group): group} if group is not None else {}
    for hook in forward_hook_functions(metric):  # our hook refers to the relay: share it, do not copy it
        memo[id(getattr(hook, "__self__", hook))] = getattr(hook, "__self__", hook)
    fresh = copy.deepcopy(metric, memo)
    fresh.reset()
    for args, kwargs in inputs:
        fresh.update(*args, **kwargs)
    # As torchmetrics' own forward: the batch value is synced only with dist_sync_on_step.
    sync_as_in_forward(fresh)
    return fresh.compute()


class Publisher:
    """Sends one step's result and logs from the last stage to its pipeline group (see the module docstring)."""

    def __init__(self, group: ProcessGroup, source: int, device: torch.device) -> None:
        self.group = group
        self.source = source
        self.device = device
        self._structure: tuple | None = None  # what the last object broadcast sent, known to every rank
        # The fast path's flag and its stand-in for an absent result (float64 scalars, copied into each message).
        self._one = torch.ones((), dtype=torch.float64, device=device)
        self._zero = torch.zeros((), dtype=torch.float64, device=device)
        self._log = RepeatedLog()

    def publish(self, module: Any, relay: MetricRelay, result: object, logs: StepLogs, objects: bool) -> Any:
        """Send the last stage's result, logs and metric changes; log them on every rank. Returns the result."""
        sending = dist.get_rank() == self.source
        result, means, metric_logs, changes = self.send(
            result, logs if sending else None, relay if sending else None, objects
        )
        if not sending:
            relay.apply(changes, self.device)
        for name, (value, kwargs) in means.items():
            self._log.log(module, name, value.to(torch.get_default_dtype()), kwargs)  # as a number logged would be
        for name, (metric_name, kwargs) in metric_logs.items():
            module.log(name, relay.metrics[metric_name], **kwargs)
        return result

    def forget_logs(self) -> None:
        """At teardown: drop the references to the trainer's result collections kept for repeated logging."""
        self._log.clear()

    def send(self, result: object, logs: StepLogs | None, relay: MetricRelay | None, objects: bool) -> tuple:
        """Collective over the pipeline group. Returns ``(result, mean logs, metric logs, metric changes)``.

        ``objects=False`` allows the fast path for a scalar (or absent) result: a flat tensor of numbers, built and
        read on the device, when the logged names and options are those of the previous step and no Metric is
        involved; the only host sync is reading its "fast path taken" flag, once per step.
        """
        sending = dist.get_rank() == self.source
        payload: tuple | None = None
        if sending:
            assert logs is not None
            metric_logs = {name: (relay.name_of(m) if relay else "", kw) for name, (m, kw) in logs.metrics.items()}
            changes = relay.end() if relay is not None else {}
            payload = (result, logs.means(self.device), metric_logs, changes)
        if not objects and self._structure is not None:
            if sending and _structure(payload) == self._structure:
                assert payload is not None
                result, means = payload[0], payload[1]
                sent = self._zero if result is None else cast(torch.Tensor, result).detach().to(torch.float64)
                numbers = torch.stack([self._one, sent, *(value for value, _ in means.values())])
            else:  # a receiver, or a sender whose payload needs objects: flag 0
                numbers = torch.zeros(2 + len(self._structure[0]), dtype=torch.float64, device=self.device)
            dist.broadcast(numbers, src=self.source, group=self.group)
            if numbers[0].item() == 1.0:  # the one host sync of a step
                return self._rebuild(numbers)
        box = [_to_cpu(payload) if sending else None]  # unpickled on each rank's device below
        dist.broadcast_object_list(box, src=self.source, group=self.group)
        payload = box[0]
        assert payload is not None
        if not objects:
            self._structure = _structure(payload)
        result, means, metric_logs, changes = _to_device(payload, self.device)
        return result, means, metric_logs, changes

    def _rebuild(self, numbers: torch.Tensor) -> tuple:
        assert self._structure is not None
        names, options, result_dtype = self._structure
        result = None if result_dtype is None else numbers[1].to(result_dtype)
        means = {name: (numbers[2 + i], dict(kwargs)) for i, (name, kwargs) in enumerate(zip(names, options))}
        return result, means, {}, {}


def _structure(payload: Any) -> tuple | None:
    """The shape of a payload that the fast path can carry as numbers, or None if it cannot."""
    result, means, metric_logs, changes = payload
    if metric_logs or changes:
        return None
    if result is not None and not (torch.is_tensor(result) and result.dim() == 0):
        return None
    try:
        options = tuple(tuple(sorted(kwargs.items())) for _, kwargs in means.values())
        hash(options)
    except TypeError:  # an unhashable option value: send objects
        return None
    return tuple(means), options, None if result is None else result.dtype


def _to_cpu(tree: _Tree) -> _Tree:
    return tree_map(lambda t: t.detach().cpu().clone() if torch.is_tensor(t) else t, tree)  # clone: no view's storage


def _to_device(tree: _Tree, device: torch.device) -> _Tree:
    return tree_map(lambda t: t.to(device) if torch.is_tensor(t) else t, tree)
