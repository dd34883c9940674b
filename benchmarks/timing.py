"""Timing the steps: wall, process and thread CPU time per step, split into phases, and a cProfile of them.

Every script times its steps with the same code so that a Trainer's step and a plain loop's compare span for span:
``LoopTimer`` times a plain loop's steps (``probes.make_step_probe`` wraps it in a Lightning callback for a Trainer):
wall time and process CPU time per step, split into forward / backward / optimizer step, and from one step's start
to the next (``iter``). ``StepProfile`` runs the same timed steps under cProfile, for a Trainer and a plain loop
alike, so that two peers' profiles compare call for call; ``PROFILED_NOTE`` is what a script prints when it did.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any

PROFILED_NOTE = (
    "NOTE: --profile runs the timed steps under cProfile, which slows Python-heavy code (Lightning's loop, DTensor"
    " dispatch) far more than kernels: the ratios of this run are not comparable; compare calls, and time without it."
)


class LoopTimer:
    """Times the steps of a plain training loop like ``StepProbe`` times a Trainer's: ``with timer.step(): ...``.

    ``timer.mark("backward")`` / ``timer.mark("optimizer")`` inside a step split it into phases. ``step(probe=cm)``
    runs the step inside the context manager ``cm`` (e.g. ``profiled_collectives``), untimed, and tells it the phase
    (``cm.phase = "backward"``) where it has one. ``iter_times``: from a timed step's start to the next step's start.
    """

    def __init__(self) -> None:
        self.times: list[float] = []
        self.cpu_times: list[float] = []
        self.thread_times: list[float] = []  # the calling (main) thread's CPU time: no gloo worker thread's
        self.phases: list[tuple[float, ...]] = []
        self.iter_times: list[float] = []
        self.iter_cpu_times: list[float] = []
        self._marks: list[tuple[float, float]] = []
        self._last_start: tuple[float, float] | None = None
        self._probe: Any = None

    def mark(self, phase: str = "") -> None:
        self._marks.append((time.perf_counter(), time.process_time()))
        if phase and hasattr(self._probe, "phase"):
            self._probe.phase = phase

    @contextmanager
    def step(self, timed: bool = True, probe: Any = None) -> Iterator[None]:
        start, thread_start = (time.perf_counter(), time.process_time()), time.thread_time()
        if self._last_start is not None:
            self.iter_times.append(start[0] - self._last_start[0])
            self.iter_cpu_times.append(start[1] - self._last_start[1])
        timed = timed and probe is None
        self._last_start, self._marks, self._probe = start if timed else None, [start], probe
        with probe if probe is not None else nullcontext():
            yield
        self._probe = None
        self.mark()
        if timed:
            (t0, c0), (t1, c1) = self._marks[0], self._marks[-1]
            self.times.append(t1 - t0)
            self.cpu_times.append(c1 - c0)
            self.thread_times.append(time.thread_time() - thread_start)
            walls = [b[0] - a[0] for a, b in zip(self._marks, self._marks[1:])]
            cpus = [b[1] - a[1] for a, b in zip(self._marks, self._marks[1:])]
            if len(walls) == 3:  # forward / backward / optimizer (a pipeline stage may see no backward hook)
                self.phases.append((*walls, *cpus))

    def result(self) -> dict[str, Any]:
        return {
            "times": self.times,
            "cpu_times": self.cpu_times,
            "thread_times": self.thread_times,
            "phases": self.phases,
            "iter_times": self.iter_times,
            "iter_cpu_times": self.iter_cpu_times,
        }


class StepProfile:
    """cProfile of a run's timed steps, the same for a Trainer (``callback()``) and a plain loop (``start``/``stop``
    around each step, ``dump`` at the end), so that two peers' profiles compare call for call.

    ``path``: the ``.prof`` file to write (``None``: do nothing); ``timed``: the steps to profile (warm-up and any
    probed step left out); ``ranks``: the global ranks that profile (``None``: every rank, each writing
    ``<path stem>-rank<r>.prof``). Timed in the calling thread's CPU time: the schedule's and gloo's worker threads
    would otherwise be charged to whatever Python function runs meanwhile.
    """

    def __init__(self, path: str | Path | None, timed: range, ranks: tuple[int, ...] | None = (0,)) -> None:
        import cProfile

        self.path, self.timed, self.ranks = (Path(path) if path else None), timed, ranks
        self.profile = cProfile.Profile(time.thread_time)
        self._on = False

    def _mine(self) -> bool:
        import torch.distributed as dist

        return self.path is not None and (self.ranks is None or dist.get_rank() in self.ranks)

    def start(self, step: int) -> None:
        if step in self.timed and self._mine():
            self.profile.enable()
            self._on = True

    def stop(self) -> None:
        if self._on:
            self.profile.disable()
            self._on = False

    def dump(self) -> None:
        import torch.distributed as dist

        if not self._mine():
            return
        assert self.path is not None
        path = self.path if self.ranks is not None else self.path.with_stem(f"{self.path.stem}-rank{dist.get_rank()}")
        path.parent.mkdir(parents=True, exist_ok=True)
        self.profile.dump_stats(str(path))

    def callback(self) -> Any:
        """The same as a Lightning callback: ``on_train_batch_start`` -> ``on_train_batch_end`` of the timed steps."""
        import lightning as L

        profile = self

        class StepProfiler(L.Callback):
            def on_train_batch_start(self, trainer: Any, *rest: Any) -> None:
                profile.start(trainer.global_step)

            def on_train_batch_end(self, *rest: Any) -> None:
                profile.stop()

            def on_train_end(self, *rest: Any) -> None:
                profile.dump()

        return StepProfiler()
