"""Where one training step's time goes, measured with timers around what blocks the training thread.

A step is cut by Lightning's hooks into *phases* (``forward_backward``: ``on_train_batch_start`` to
``on_before_optimizer_step``; ``optimizer``: from there to ``on_train_batch_end``; ``other``: the rest of the
interval between two step ends: the data fetch, Lightning's loop, logging). Inside the phases, *intervals* are
timed where the thread waits on something else: the data fetch, every collective of ``torch.distributed`` and of
its functional collectives (DTensor's tensor-parallel traffic), and every ``Work.wait()``. Each collective is
attributed to a mesh axis by its process group. A phase's own category (compute, optimizer, other) is its
duration minus the intervals inside it, so the parts of a step add up to its wall time.

Pipeline traffic (``batch_isend_irecv`` on the ``pp`` group) is split in two: waiting for a receive is the
*bubble* (the peer stage has not produced its activation or gradient yet), issuing the transfers and waiting for
sends is ``pp`` communication.

*Exposed* communication is the time the training thread is blocked in a collective or its ``wait()``; an
asynchronous collective is *overlapped* (at most) from the return of its issue to the start of its wait, while the
thread computes. Only the training thread is timed (a background checkpoint thread's collectives are not).

Timers are CUDA events on the current stream on GPU (resolved once per measured step, after one synchronize) and
``time.perf_counter`` elsewhere; nothing adds a barrier. Every patch is undone by :meth:`CollectiveTimer.remove`.
"""

from __future__ import annotations

import enum
import functools
import inspect
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Final, cast

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from lightning_mgpu._compat.c10d import functional_collectives, group_name, pipelining_p2p
from lightning_mgpu._compat.lightning import fetcher_profiler_hooks, set_fetcher_profiler_hooks
from lightning_mgpu.layout import DP_AXIS, DP_CP_AXIS

if TYPE_CHECKING:
    from lightning_mgpu._compat.lightning import DataFetcher

FORWARD_BACKWARD = "forward_backward"
OPTIMIZER = "optimizer"
OTHER = "other"
DATA_WAIT = "data_wait"
BUBBLE = "bubble"
COMPUTE = "compute"
# What a phase's unclaimed time is called in the split.
_PHASE_CATEGORY = {FORWARD_BACKWARD: COMPUTE, OPTIMIZER: OPTIMIZER, OTHER: OTHER}


class _Untimed(enum.Enum):
    TOKEN = "untimed"


_UNTIMED: Final = _Untimed.TOKEN  # what `open` returns outside a measured step or on another thread: `close` ignores
Mark = torch.cuda.Event | float  # a CUDA event on GPU, `time.perf_counter()` elsewhere

# Collectives of torch.distributed timed as blocking calls (isend/irecv are left alone: P2POp checks identity).
_DIST_CALLS = (
    "all_reduce",
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_single",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "reduce_scatter_single",
    "broadcast",
    "reduce",
    "all_to_all",
    "all_to_all_single",
    "gather",
    "scatter",
    "send",
    "recv",
    "barrier",
    "broadcast_object_list",
    "all_gather_object",
    "batch_isend_irecv",
)
# Functional collectives (DTensor redistributions): issued asynchronously, waited in `wait_tensor`.
_FUNCOL_CALLS = (
    "all_reduce",
    "all_gather_tensor",
    "all_gather_single",
    "reduce_scatter_tensor",
    "reduce_scatter_single",
    "all_to_all_single",
    "broadcast",
    "all_reduce_coalesced",
    "all_gather_into_tensor_coalesced",
    "reduce_scatter_tensor_coalesced",
)


class Clock:
    """Marks on the host clock, or CUDA events on the current stream (read after one synchronize per step)."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda" and torch.cuda.is_available()

    def mark(self) -> Mark:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def seconds(self, start: Mark, end: Mark) -> float:
        if self.cuda:
            return cast(torch.cuda.Event, start).elapsed_time(cast(torch.cuda.Event, end)) / 1e3
        return cast(float, end) - cast(float, start)

    def synchronize(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()


class StepRecorder:
    """Phase marks and timed intervals of the step being measured; :meth:`finish` turns them into seconds."""

    def __init__(self, clock: Clock) -> None:
        self.clock = clock
        self.active = False
        self.phase = OTHER
        self._depth = 0
        self._calls = 0
        self._marks: list[tuple[str, Mark]] = []
        self._intervals: list[tuple[str, str, Mark, Mark]] = []
        self._overlaps: list[tuple[str, Mark, Mark]] = []
        self._thread = threading.get_ident()

    def begin(self, start: Mark) -> None:
        """Measure the step that started at ``start`` (a mark taken when the previous step ended)."""
        self.active, self.phase, self._depth, self._calls = True, OTHER, 0, 0
        self._marks, self._intervals, self._overlaps = [(OTHER, start)], [], []
        self._thread = threading.get_ident()

    def enter(self, phase: str) -> None:
        self.phase = phase
        if self.active:
            self._marks.append((phase, self.clock.mark()))

    def open(self) -> Mark | _Untimed | None:
        """Start an interval; nested ones (a collective calling another, or its own ``wait``) count once."""
        if not self.active or threading.get_ident() != self._thread:
            return _UNTIMED
        self._depth += 1
        self._calls += 1
        return self.clock.mark() if self._depth == 1 else None

    def close(self, start: Mark | _Untimed | None, category: str) -> Mark | None:
        """End an interval; returns its end mark when it was timed (an outermost one in a measured step)."""
        if start is _UNTIMED:
            return None
        self._depth -= 1
        if start is None:
            return None
        end = self.clock.mark()
        self._intervals.append((self.phase, category, start, end))
        return end

    def overlap(self, axis: str, issued: Mark, waited: Mark) -> None:
        """An asynchronous collective's issue returned at ``issued``; its wait began at ``waited``."""
        if self.active:
            self._overlaps.append((axis, issued, waited))

    def finish(self, end: Mark) -> dict[str, float | dict[str, float] | int]:
        """The step's wall time, its parts (seconds, adding up to the wall), overlapped communication per axis and
        the number of timed calls (collectives, waits and fetches, nested ones included)."""
        self.active = False
        self.clock.synchronize()
        seconds = self.clock.seconds
        parts: dict[str, float] = {}
        marks = self._marks + [(OTHER, end)]
        for (phase, start), (_, stop) in zip(marks, marks[1:]):
            category = _PHASE_CATEGORY[phase]
            parts[category] = parts.get(category, 0.0) + seconds(start, stop)
        for phase, category, start, stop in self._intervals:
            elapsed = seconds(start, stop)
            parts[category] = parts.get(category, 0.0) + elapsed
            owner = _PHASE_CATEGORY[phase]
            parts[owner] = parts[owner] - elapsed
        overlapped: dict[str, float] = {}
        for axis, issued, waited in self._overlaps:
            overlapped[axis] = overlapped.get(axis, 0.0) + seconds(issued, waited)
        return {
            "wall_s": seconds(self._marks[0][1], end),
            "parts_s": parts,
            "overlapped_s": overlapped,
            "timed_calls": self._calls,
        }


class CollectiveTimer:
    """Reversible timers around ``torch.distributed`` collectives, functional collectives and ``Work.wait``."""

    def __init__(self, recorder: StepRecorder, axes: dict[str, str], world_axis: str) -> None:
        self.recorder = recorder
        self._axes = axes  # process group name -> axis name
        self._world_axis = world_axis
        self._by_group: dict[int, str] = {}
        self._works: dict[int, tuple[str, bool, Mark | None]] = {}  # id(work) -> (axis, is a receive, issue's end)
        self._pending: dict[int, tuple[str, Mark | None]] = {}  # id(funcol output) -> (axis, issue's end mark)
        self._undo: list[tuple[object, str, object]] = []

    # ------------------------------------------------------------------------------------------ install / remove
    def install(self) -> None:
        funcol = functional_collectives()
        for name in _DIST_CALLS:
            if hasattr(dist, name):
                self._patch(dist, name, self._wrap_dist(getattr(dist, name), name == "batch_isend_irecv"))
        for name in _FUNCOL_CALLS:
            if hasattr(funcol, name):
                self._patch(funcol, name, self._wrap_funcol(getattr(funcol, name)))
        self._patch(funcol, "wait_tensor", self._wrap_wait_tensor(funcol.wait_tensor))
        p2p = pipelining_p2p()
        if p2p is not None:  # torch's pipelining sends and receives through it
            owner, name = p2p
            self._patch(owner, name, self._wrap_dist(getattr(owner, name), p2p=True))
        self._patch(dist.Work, "wait", self._wrap_work_wait(dist.Work.wait))

    def remove(self) -> None:
        for owner, name, original in reversed(self._undo):
            setattr(owner, name, original)
        self._undo = []
        self._works.clear()
        self._pending.clear()

    def _patch(self, owner: object, name: str, wrapper: Callable) -> None:
        self._undo.append((owner, name, getattr(owner, name)))
        setattr(owner, name, wrapper)

    # ----------------------------------------------------------------------------------------------- attribution
    def axis_of(self, group: object) -> str:
        if group is None:
            return self._world_axis
        key = id(group)
        axis = self._by_group.get(key)
        if axis is None:
            try:
                name = group.group_name if isinstance(group, dist.ProcessGroup) else _funcol_group_name(group)
            except Exception:
                name = None
            axis = self._axes.get(name, "other") if name is not None else "other"
            if isinstance(group, (dist.ProcessGroup, str)):
                self._by_group[key] = axis  # long-lived objects only: ids of temporary tuples get reused
        return axis

    # -------------------------------------------------------------------------------------------------- wrappers
    def _wrap_dist(self, original: Callable, p2p: bool) -> Callable:
        recorder = self.recorder

        @functools.wraps(original)
        def timed(*args: object, **kwargs: object) -> object:
            if not recorder.active or torch.compiler.is_compiling():
                return original(*args, **kwargs)
            if p2p:
                ops = cast(
                    "list[dist.P2POp]", args[0] if args else kwargs.get("p2p_ops", kwargs.get("p2p_op_list", []))
                )
                axis = self.axis_of(ops[0].group) if ops else self._world_axis
            else:
                axis = self.axis_of(_group_argument(args, kwargs))
            start = recorder.open()
            try:
                result = original(*args, **kwargs)
            finally:
                end = recorder.close(start, f"comm_{axis}")
            if end is not None and result is not None:
                if p2p:
                    self._remember_p2p(ops, result, axis, end)
                elif isinstance(result, dist.Work):
                    self._works[id(result)] = (axis, False, end)
            return result

        return timed

    def _remember_p2p(self, ops: list[dist.P2POp], works: object, axis: str, issued: Mark) -> None:
        works = list(works) if isinstance(works, (list, tuple)) else [works]
        receives = [op.op.__name__ == "irecv" for op in ops]
        for k, work in enumerate(works):
            receive = receives[k] if len(works) == len(ops) else any(receives)
            self._works[id(work)] = (axis, receive, issued)

    def _wrap_funcol(self, original: Callable) -> Callable:
        recorder = self.recorder
        names = list(inspect.signature(original).parameters)
        index = names.index("group") if "group" in names else None

        @functools.wraps(original)
        def timed(*args: object, **kwargs: object) -> object:
            if not recorder.active or torch.compiler.is_compiling():
                return original(*args, **kwargs)
            group = kwargs.get("group", args[index] if index is not None and len(args) > index else None)
            axis = self.axis_of(group)
            start = recorder.open()
            try:
                result = original(*args, **kwargs)
            finally:
                end = recorder.close(start, f"comm_{axis}")
            if end is not None:
                for tensor in result if isinstance(result, (list, tuple)) else [result]:
                    self._pending[id(getattr(tensor, "elem", tensor))] = (axis, end)
            return result

        return timed

    def _wrap_wait_tensor(self, original: Callable) -> Callable:
        recorder = self.recorder

        @functools.wraps(original)
        def timed(tensor: torch.Tensor, *args: object, **kwargs: object) -> object:
            if not recorder.active or torch.compiler.is_compiling():
                return original(tensor, *args, **kwargs)
            axis, issued = self._issued_before(tensor)
            start = recorder.open()
            try:
                return original(tensor, *args, **kwargs)
            finally:
                if recorder.close(start, f"comm_{axis}") is not None and issued is not None:
                    recorder.overlap(axis, issued, cast(Mark, start))  # timed by `close`: a mark

        return timed

    def _issued_before(self, tensor: torch.Tensor) -> tuple[str, Mark | None]:
        """The issue of the functional collective ``tensor`` waits for; the oldest one in flight when autograd
        wrapped its output in another tensor object."""
        found = self._pending.pop(id(tensor), None)
        if found is None and self._pending:
            found = self._pending.pop(next(iter(self._pending)))
        return found or ("other", None)

    def forget(self) -> None:
        """Drop what earlier steps issued and never waited for through Python."""
        self._works.clear()
        self._pending.clear()

    def _wrap_work_wait(self, original: Callable) -> Callable:
        recorder = self.recorder

        @functools.wraps(original)
        def timed(work: dist.Work, *args: object, **kwargs: object) -> object:
            if not recorder.active:
                return original(work, *args, **kwargs)
            axis, receive, issued = self._works.pop(id(work), ("other", False, None))
            start = recorder.open()
            try:
                return original(work, *args, **kwargs)
            finally:
                # A pipeline stage waiting to receive waits for its neighbour's compute (the bubble); the ring of
                # context parallelism waits for a key/value block in flight (communication).
                waited = BUBBLE if receive and axis == "pp" else f"comm_{axis}"
                if recorder.close(start, waited) is not None and issued is not None:
                    recorder.overlap(axis, issued, cast(Mark, start))  # timed by `close`: a mark

        return timed


class DataFetchTimer:
    """Times the training data fetch through the hooks Lightning's fetcher calls around ``next(iterator)``.

    The epoch loop sets the fetcher's ``_start_profiler``/``_stop_profiler`` at each epoch's start, so
    :meth:`install` is called before every step and wraps them again when they were replaced.
    """

    def __init__(self, recorder: StepRecorder) -> None:
        self.recorder = recorder
        self._fetcher: DataFetcher | None = None
        self._originals: tuple[Callable, Callable] = (_nothing, _nothing)
        self._wrappers: tuple[Callable, Callable] = (_nothing, _nothing)

    def install(self, fetcher: DataFetcher | None) -> None:
        hooks = fetcher_profiler_hooks(fetcher) if fetcher is not None else None
        if fetcher is None or hooks is None:
            return
        if fetcher is self._fetcher and hooks[0] is self._wrappers[0]:
            return
        self.remove()
        recorder = self.recorder
        before, after = hooks
        token: list[Mark | _Untimed | None] = [None]

        def start() -> None:
            before()
            token[0] = recorder.open()

        def stop() -> None:
            recorder.close(token[0], DATA_WAIT)
            after()

        set_fetcher_profiler_hooks(fetcher, start, stop)
        self._fetcher, self._originals, self._wrappers = fetcher, (before, after), (start, stop)

    def remove(self) -> None:
        fetcher = self._fetcher
        hooks = fetcher_profiler_hooks(fetcher) if fetcher is not None else None  # one with hooks, as installed
        if fetcher is not None and hooks is not None and hooks[0] is self._wrappers[0]:
            set_fetcher_profiler_hooks(fetcher, *self._originals)
        self._fetcher = None


def _nothing() -> None:
    pass


def mesh_axes(mesh: DeviceMesh | None) -> dict[str, str]:
    """Process group name -> short axis name (``tp``, ``pp``, ``dp``, ...) for every split dimension of ``mesh``."""
    axes: dict[str, str] = {}
    if mesh is None or not mesh.mesh_dim_names:
        return axes
    for dim, name in enumerate(mesh.mesh_dim_names):
        if mesh.size(dim) > 1:
            axes[mesh.get_group(dim).group_name] = _short_axis(name)
    for flattened in (DP_AXIS, DP_CP_AXIS):  # dp over (dp_replicate, dp_shard); gradients over dp x cp
        if flattened not in mesh.mesh_dim_names:
            try:
                group = mesh[flattened].get_group()
            except (KeyError, RuntimeError):
                continue
            axes.setdefault(group.group_name, "dp")
    return axes


def _short_axis(name: str) -> str:
    lowered = name.lower()
    for short, words in (
        ("tp", ("tensor", "tp")),
        ("pp", ("pipe", "pp")),
        ("dp", ("data", "dp", "shard", "replicate")),
        ("ep", ("expert", "ep")),
        ("cp", ("context", "cp")),
    ):
        if any(word in lowered for word in words):
            return short
    return lowered


def _group_argument(args: tuple, kwargs: dict) -> object:
    group = kwargs.get("group")
    if group is not None:
        return group
    for value in args:
        if isinstance(value, dist.ProcessGroup):
            return value
    return None


def _funcol_group_name(group: object) -> str | None:
    return group_name(group)
