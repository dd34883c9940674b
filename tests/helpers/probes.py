"""Callbacks that look inside a run: memory held per rank, collectives issued per step."""

from __future__ import annotations

import math
from collections import Counter
from typing import Any

import lightning as L
import torch
from torch.distributed.tensor import DTensor


def local_bytes(tensor: torch.Tensor) -> int:
    local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
    return local.numel() * local.element_size()


class MemoryProbe(L.Callback):
    """Bytes held in parameters, gradients and optimizer state right after backward, before the optimizer step.

    Measured at ``step`` (>= 1, so optimizer states exist); scalar state such as Adam's ``step`` is left out.
    """

    def __init__(self, step: int = 1) -> None:
        self.step = step
        self.results: dict[str, Any] = {}

    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: Any) -> None:
        if trainer.global_step != self.step:
            return
        params = list(pl_module.parameters())
        state = [t for s in optimizer.state.values() for t in s.values() if torch.is_tensor(t) and t.dim() > 0]
        self.results = {
            "numel": sum(p.numel() for p in params),  # global numel, whatever the sharding
            "largest_numel": max(p.numel() for p in params),
            "param_bytes": sum(local_bytes(p) for p in params),
            "grad_bytes": sum(local_bytes(p.grad) for p in params if p.grad is not None),
            "optim_bytes": sum(local_bytes(t) for t in state),
        }


class CollectiveCounter(L.Callback):
    """Counts the collectives each training batch issues, by kind (``AR``, ``RS``, ``AG``, ``BC``, ``RD``).

    Read from ``torch.profiler`` (``collectives_of``), so collectives issued from C++ (DDP's reducer) count too.
    ``per_batch``: ops with more than one element (logging syncs left out); ``bytes_per_batch``: the ring bytes
    this rank sent for them. ``batches``: profile only the first that many training batches (the profiler costs
    more than a tiny model's step); all of them by default.
    """

    def __init__(self, batches: int | None = None) -> None:
        self.results: dict[str, Any] = {"per_batch": [], "bytes_per_batch": [], "bytes_by_kind_per_batch": []}
        self._profiler: Any = None
        self._batches = batches

    def on_train_batch_start(self, trainer: L.Trainer, *args: Any) -> None:
        from torch.profiler import ProfilerActivity, profile

        if self._batches is not None and len(self.results["per_batch"]) >= self._batches:
            return

        self._profiler = profile(activities=[ProfilerActivity.CPU], record_shapes=True)
        self._profiler.__enter__()

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        if self._profiler is None:
            return
        self._profiler.__exit__(None, None, None)
        comm = collectives_of(self._profiler, trainer.world_size)
        self.results["per_batch"].append(comm["counts"])
        self.results["bytes_per_batch"].append(comm["bytes"])
        self.results["bytes_by_kind_per_batch"].append(comm["bytes_by_kind"])
        self._profiler = None


# c10d op -> kind; the ring bytes a rank sends for a B-byte (unsharded) tensor, as a fraction f=(w-1)/w of B.
_C10D_KINDS = {
    "allreduce": ("AR", 2.0),
    "reduce_scatter": ("RS", 1.0),
    "allgather": ("AG", 1.0),
    "broadcast": ("BC", 1.0),
    "reduce_": ("RD", 1.0),
    "alltoall": ("A2A", 1.0),
    "barrier": ("BAR", 0.0),
}
# Backend work item ("gloo:all_reduce", "nccl:_reduce_scatter_base", ...) -> kind; "reduce" last, inside the others.
_WORK_KINDS = {"allreduce": "AR", "reducescatter": "RS", "allgather": "AG", "broadcast": "BC", "alltoall": "A2A"}
_WORK_KINDS |= {"barrier": "BAR", "reduce": "RD"}
_RUN_AS = {"RS": ("RS", "AR")}  # gloo runs reduce-scatter as an all-reduce (work item "gloo:all_reduce")


def _work_kind(name: str) -> str:
    flat = name.split(":", 1)[1].replace("_", "")
    return next((kind for key, kind in _WORK_KINDS.items() if key in flat), "OTHER")


def _numel(shapes: Any) -> int:
    return sum(math.prod(s) for s in (shapes or []) if s and all(isinstance(d, int) for d in s))


def _kind_of(op: Any) -> tuple[str, float]:
    return next((v for k, v in _C10D_KINDS.items() if k in op.name), ("OTHER", 0.0))


def _pair_with_work(ops: list[Any], work: list[Any]) -> list[tuple[Any, Any]]:
    """Each op with the backend work item that ran it: an unclaimed one of its kind, the earliest started.

    Not simply the next one: gloo starts its work items (and their profiler events) on two worker threads, so
    async ops issued back to back (a DDP hook's reduces, the reducer's unused-parameter all-reduce) may start in
    either order. Within one kind the order changes neither counts nor bytes. Ops with tensor (not list)
    arguments, e.g. ``_reduce_scatter_base_``, first claim the item of their unsharded size: gloo's reduce-scatter
    and all-reduce items share a name."""
    unclaimed = list(work)
    paired: dict[int, Any] = {}

    def claim(index: int, item: Any) -> None:
        paired[index] = item
        unclaimed.remove(item)

    for index, op in enumerate(ops):
        kinds = _RUN_AS.get(_kind_of(op)[0], (_kind_of(op)[0],))
        own = max((_numel([s]) for s in op.input_shapes or []), default=0)
        item = next((w for w in unclaimed if _work_kind(w.name) in kinds and _numel(w.input_shapes) == own), None)
        if own > 0 and item is not None:
            claim(index, item)
    for index, op in enumerate(ops):
        kinds = _RUN_AS.get(_kind_of(op)[0], (_kind_of(op)[0],))
        item = next((w for w in unclaimed if _work_kind(w.name) in kinds), None)
        if index not in paired and item is not None:
            claim(index, item)
    return [(op, paired[index]) for index, op in enumerate(ops) if index in paired]


def collectives_of(profiler: Any, world_size: int, dtype_bytes: int = 4) -> dict[str, Any]:
    """The collectives a ``torch.profiler`` run saw this rank issue (Python or C++ callers, e.g. DDP's reducer).

    Each ``c10d::`` op is paired with the backend work item that ran it (``_pair_with_work``), whose input shape
    gives the size (``dtype_bytes`` per element). Returns ``counts`` (ops per kind with more than one element: the
    model's traffic), ``small`` (one-element ops: logging syncs), and ``bytes``: the ring-algorithm bytes this rank
    sends for them: all-reduce 2(w-1)/w x B, reduce-scatter / all-gather (w-1)/w x B of the unsharded tensor,
    broadcast and reduce (w-1)/w x B. gloo runs reduce-scatter as an all-reduce, so its work item is the unsharded
    input.
    """
    events = sorted(profiler.events(), key=lambda e: e.time_range.start)
    ops = [e for e in events if e.name.startswith("c10d::")]
    work = [e for e in events if e.name.startswith(("gloo:", "nccl:"))]
    counts: Counter = Counter()
    small: Counter = Counter()
    by_kind: Counter = Counter()
    sent = 0.0
    f = (world_size - 1) / world_size if world_size > 1 else 0.0
    for op, item in _pair_with_work(ops, work):
        kind, factor = _kind_of(op)
        numel = _numel(item.input_shapes)
        if "allgather" in op.name and "gloo" in item.name:
            numel *= world_size  # the work item holds this rank's input; the unsharded tensor is w times larger
        if numel <= 1:
            small[kind] += 1
            continue
        counts[kind] += 1
        sent += factor * f * numel * dtype_bytes
        by_kind[kind] += factor * f * numel * dtype_bytes
    return {"counts": dict(counts), "small": dict(small), "bytes": sent, "bytes_by_kind": dict(by_kind)}


class MetricRecorder(L.Callback):
    """Records logged metrics as global rank 0's loggers see them: validation ones after each validation run."""

    def __init__(self, validation_key: str = "val_loss") -> None:
        self.validation_key = validation_key
        self.results: dict[str, Any] = {"val_losses": [], "predictions": None}

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.validation_key in trainer.callback_metrics:
            self.results["val_losses"].append(float(trainer.callback_metrics[self.validation_key]))


# ---------------------------------------------------------------------------------------------- host memory
def status_kib(field: str) -> int:
    """A ``/proc/self/status`` reading in KiB: ``VmRSS`` (resident now), ``VmHWM`` (its high-water mark)."""
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith(field + ":"))


def reset_peak_rss() -> None:
    """Start ``VmHWM`` again from the current resident size (Linux: ``5`` written to ``/proc/self/clear_refs``)."""
    with open("/proc/self/clear_refs", "w") as refs:
        refs.write("5")


class SetupMemory(L.Callback):
    """The process's peak resident memory from ``reset_peak_rss()`` to the start of training (the weights loaded),
    and the parameter bytes this rank then holds (its shards) and the largest whole parameter."""

    def __init__(self) -> None:
        self.results: dict[str, Any] = {}

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        params = {id(p): p for p in pl_module.parameters()}.values()
        self.results = {
            "peak_kib": status_kib("VmHWM"),
            "held_bytes": sum(local_bytes(p) for p in params),
            "largest_bytes": max(p.numel() * p.element_size() for p in params),
        }
