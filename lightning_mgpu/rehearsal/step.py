"""One training step of a rehearsed rank, to count the collectives it issues on each mesh axis.

The rank's LightningModule is built again under torch's ``FakeTensorMode`` (tensors with shapes and no data: a
step runs through FSDP2, DTensor and DDP without memory or arithmetic), set up by the library's own path, then one
``training_step`` on a batch of token ids ``(input_ids, next ids)`` runs forward, backward and the optimizer step
under a dispatch mode that records every collective (eager ``c10d`` ops and the functional ones DTensor issues) with
the process group it ran on. The fake process group returns at once.

``configured`` and ``optimizers_of`` build the module and its optimizers as the Trainer would, for this pass and
the bytes pass (``rehearsal.run``). Pipeline stages are not stepped: the schedule's first step exchanges tensor shapes
with the neighbouring stages' real processes. Nor is a step a model cannot take on data-free tensors (a branch on
values): its note says why, and the rank's bytes stand.
"""

from __future__ import annotations

import warnings
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from lightning_mgpu._compat.fake import FakeTensorMode, TorchDispatchMode
from lightning_mgpu.layout import ParallelLayout
from lightning_mgpu.options import ParallelOptions

# Per axis and collective kind: how many calls one step issues, and the bytes of their largest buffers.
Collectives = dict[str, dict[str, dict[str, int]]]


@dataclass(frozen=True)
class StepBatch:
    """The micro-batch one rank's step takes: ``sequences`` x ``tokens`` ids below ``vocabulary``, at
    ``precision`` (a mixed precision's autocast sets the activations' dtype, and with it the bytes moved)."""

    sequences: int
    tokens: int
    vocabulary: int
    precision: str = "32-true"


_NOT_COUNTED_WITH_PIPELINE = (
    "not counted: a pipeline stage's first step exchanges tensor shapes with its neighbours' real processes"
)


# FakeTensorMode's errors for an output whose shape depends on values (torch._subclasses.fake_tensor), by name.
_DATA_DEPENDENT = ("DynamicOutputShapeException", "DataDependentOutputException")


def count_step_collectives(
    build: Callable[[], nn.Module],
    layout: ParallelLayout,
    options: ParallelOptions,
    batch: StepBatch,
) -> tuple[Collectives | None, str]:
    """``(collectives per axis, note)`` for one training step of this process's rank on ``batch`` (its fake
    process group is initialized)."""
    if layout.pipeline_parallel_size > 1:
        return None, _NOT_COUNTED_WITH_PIPELINE
    try:
        return _step(build, layout, options, batch), ""
    except Exception as error:  # noqa: BLE001 - a step on data-free tensors may fail where the real one would not
        if type(error).__name__ in _DATA_DEPENDENT:
            operator = str(error)[:200]
            return None, (
                f"not counted: {operator} makes a shape from the data (expert routing's token counts, ...), which a"
                " step on fake tensors cannot run"
            )
        return None, f"not counted: one step on fake tensors failed ({type(error).__name__}: {error})"[:400]


def _step(
    build: Callable[[], nn.Module],
    layout: ParallelLayout,
    options: ParallelOptions,
    batch: StepBatch,
) -> Collectives:

    from lightning_mgpu._compat.dtensor import forget_meshes
    from lightning_mgpu.backends.torch_data_parallel import TorchDataParallel
    from lightning_mgpu.monitor.timing import mesh_axes
    from lightning_mgpu.parallel import parallelize
    from lightning_mgpu.parallel.data import finish_backward
    from lightning_mgpu.patches import PatchLog
    from lightning_mgpu.precision import HybridPrecision
    from lightning_mgpu.strategy.step import run_step, step_context

    forget_meshes()  # the bytes pass's mesh has this one's shape: its cached specs would name its groups
    mesh = layout.build_mesh("cpu")  # real tensors: the mesh reads its ranks
    fake = FakeTensorMode(allow_non_fake_inputs=True)
    with fake:  # the parameters and the batch: shapes only; everything else runs as in the real job
        module = configured(build)
        ids = torch.randint(0, batch.vocabulary, (batch.sequences, batch.tokens))
    precision = HybridPrecision(batch.precision, "cpu")
    patches = PatchLog()
    device = torch.device("cpu")
    run = parallelize(module, layout, mesh, options, precision, device, patches, TorchDataParallel())
    optimizers = optimizers_of(module)
    roots = run.roots
    run.wire_optimizers(optimizers, module, layout, mesh, precision, patches)
    for root in roots:
        _reduce_buckets_eagerly(root, layout, mesh)
    recorder = _CollectiveRecorder(mesh_axes(mesh))
    with recorder, _undone(patches), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the bytes pass showed the module's warnings; `self.log` has no Trainer here
        with precision.train_step_context():
            context = step_context(layout, options, "training_step")
            loss = run_step(run.runner, run, module, context, "training_step", ((ids, ids), 0), {})
        loss = loss["loss"] if isinstance(loss, dict) else loss
        with step_context(layout, options, "training_step"):
            loss.backward()
        finish_backward(roots)
        for optimizer in optimizers:
            optimizer.step()
    return recorder.counted()


def configured(build: Callable[[], nn.Module]) -> nn.Module:
    """The module as the Trainer would set it up: built, then its ``configure_model`` hook called."""
    module = build()
    configure = getattr(module, "configure_model", None)
    if callable(configure):
        configure()
    return module


def optimizers_of(module: nn.Module) -> list[torch.optim.Optimizer]:
    """The module's ``configure_optimizers`` answer as a list of optimizers (schedulers and dicts unpacked)."""
    configure = getattr(module, "configure_optimizers", None)
    found = configure() if callable(configure) else None
    items = found if isinstance(found, (list, tuple)) else [found]
    optimizers = []
    for item in items:
        if isinstance(item, dict):
            item = item.get("optimizer")
        if isinstance(item, (list, tuple)):
            optimizers += [o for o in item if isinstance(o, torch.optim.Optimizer)]
        elif isinstance(item, torch.optim.Optimizer):
            optimizers.append(item)
    return optimizers


@contextmanager
def _undone(patches: Any) -> Iterator[None]:
    try:
        yield
    finally:
        patches.undo()


def _reduce_buckets_eagerly(root: nn.Module, layout: ParallelLayout, mesh: DeviceMesh) -> None:
    """DDP's built-in all-reduce reads its result from the work's future, which the fake process group leaves
    empty: a root without a communication hook of its own gets one issuing the same all-reduce per bucket."""
    from lightning_mgpu.layout import DP_AXIS

    register = getattr(root, "register_comm_hook", None)
    if register is None or getattr(root, "_lightning_mgpu_owner_reduce", None) is not None:
        return  # FSDP2, or ZeRO-1's owner reduce (its futures are collected, not read)
    group = mesh[DP_AXIS].get_group()

    def all_reduce(state, bucket):  # type: ignore[no-untyped-def]  # untyped: DDP checks the hook's annotations
        dist.all_reduce(bucket.buffer(), group=group)
        done: torch.futures.Future = torch.futures.Future()
        done.set_result(bucket.buffer())
        return done

    register(None, all_reduce)


class _CollectiveRecorder(TorchDispatchMode):
    """Every ``c10d``/``_c10d_functional`` op dispatched (not their waits), by mesh axis and kind."""

    def __init__(self, axes: dict[str, str]) -> None:
        super().__init__()
        self.axes = axes
        self.calls: dict[str, dict[str, list[int]]] = defaultdict(lambda: defaultdict(lambda: [0, 0]))

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        namespace, _, rest = str(func).partition(".")
        kind = rest.split(".")[0].strip("_")
        if namespace in ("c10d", "_c10d_functional") and not kind.startswith(("wait", "wrap")):
            entry = self.calls[self._axis(args)][kind]
            entry[0] += 1
            entry[1] += max((t.numel() * t.element_size() for t in _tensors(args)), default=0)
        return func(*args, **(kwargs or {}))

    def _axis(self, args: tuple) -> str:
        for arg in args:
            if isinstance(arg, str) and arg in self.axes:
                return self.axes[arg]
            if isinstance(arg, torch.ScriptObject):
                try:
                    name = dist.ProcessGroup.unbox(arg).group_name
                except (RuntimeError, TypeError):
                    continue
                return self.axes.get(name, name)
        return "?"

    def counted(self) -> Collectives:
        return {
            axis: {kind: {"calls": calls, "bytes": size} for kind, (calls, size) in sorted(kinds.items())}
            for axis, kinds in sorted(self.calls.items())
        }


def _tensors(args: Any) -> list[torch.Tensor]:
    found: list[torch.Tensor] = []
    for arg in args:
        if isinstance(arg, torch.Tensor):
            found.append(arg)
        elif isinstance(arg, (list, tuple)):
            found += _tensors(arg)
    return found


def describe_collectives(collectives: Collectives) -> str:
    """``tp all_reduce 18 (2.1 MiB), dp allgather_base 9 (...)``."""
    parts = []
    for axis, kinds in collectives.items():
        for kind, entry in kinds.items():
            parts.append(f"{axis} {kind} {entry['calls']} ({entry['bytes'] / 2**20:.1f} MiB)")
    return ", ".join(parts) or "none"
