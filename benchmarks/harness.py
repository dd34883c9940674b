"""The shared benchmark harness: launch a configuration, time its steps, probe memory and collectives, print ratios.

Every per-topic script (``bench_*.py``) is a list of configurations, each a job run in its own set of forked gloo
processes (``tests/helpers/distributed.run_distributed``), plus its own analytic expectations. The harness does the
rest the same way for all of them, so that a ratio means the same in every table:

- ``run_interleaved``: every configuration once per repeat, the repeats interleaved, so that a slow drift of a shared
  machine hits every configuration alike; one failing configuration prints one line and does not hide the others.
- ``StepProbe`` (a Lightning callback) and ``LoopTimer`` (for plain loops): wall time and process CPU time per step
  (``on_train_batch_start`` -> ``on_train_batch_end``, or the same work in a loop), split into forward / backward /
  optimizer step; memory per rank right after backward (``memory_per_rank``); the collectives of one extra,
  untimed step (``profiled_collectives``).
- ``summarize``: per step the slowest rank, warm-up steps dropped, repeats pooled; ``ratio_table``: each
  configuration against its peer, the median of the per-repeat ratios with their range (the spread of the noise).
"""

from __future__ import annotations

import logging
import os
import statistics
import sys
import time
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Optional

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

import torch  # noqa: E402

from tests.helpers.distributed import run_distributed  # noqa: E402
from tests.helpers.probes import collectives_of, local_bytes  # noqa: E402

SEED = 1234
MB = 2**20
# Every benchmark Trainer: no logger, checkpoints, progress bar, summary or validation to time alongside the steps.
QUIET_TRAINER = dict(logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                     num_sanity_val_steps=0, limit_val_batches=0)


# ------------------------------------------------------------------------------------------------ launching
def run_or_report(name: str, job: Callable[..., Any], nprocs: int, *args: Any, timeout: float = 300.0,
                  verbose: bool = False) -> Optional[list[Any]]:
    """``job(*args)`` on ``nprocs`` forked ranks; on failure print one line (all of it with ``verbose``), return None."""
    try:
        return run_distributed(job, nprocs, *args, timeout=timeout)
    except Exception as err:
        print(f"{name}: FAILED: {str(err).strip().splitlines()[-1]}", flush=True)
        if verbose:
            print(err)
        return None


def run_interleaved(jobs: dict[str, tuple[Callable[..., Any], int, tuple]], repeats: int, timeout: float = 300.0,
                    verbose: bool = False, report: Optional[Callable[[str, list[Any]], str]] = None) -> dict[str, list]:
    """Run ``{name: (job, nprocs, args)}`` ``repeats`` times, interleaved; returns ``{name: [outputs per repeat]}``.

    ``report(name, outputs)`` makes the progress line printed after each run.
    """
    runs: dict[str, list[list[Any]]] = {name: [] for name in jobs}
    for repeat in range(repeats):
        for name, (job, nprocs, args) in jobs.items():
            if repeat and not runs[name]:
                continue  # failed before
            t0 = time.perf_counter()
            outputs = run_or_report(name, job, nprocs, *args, timeout=timeout, verbose=verbose)
            if outputs is None:
                continue
            runs[name].append(outputs)
            line = report(name, outputs) if report else ""
            print(f"[{repeat + 1}/{repeats}] {name}: {line} ({time.perf_counter() - t0:.1f} s job)", flush=True)
    return {name: done for name, done in runs.items() if done}


def quiet_worker(verbose: bool) -> None:
    """Inside a rank: silence warnings and Lightning's/torch's info logs unless ``verbose``."""
    if verbose:
        return
    warnings.filterwarnings("ignore")
    for name in ("lightning", "lightning.pytorch", "lightning.fabric", "torch.distributed", "deepspeed", "DeepSpeed"):
        logging.getLogger(name).setLevel(logging.ERROR)


@contextmanager
def quiet_fds(enabled: bool = True) -> Iterator[None]:
    """Send this process's stdout/stderr file descriptors to /dev/null (kineto prints on the raw descriptors)."""
    if not enabled:
        yield
        return
    sys.stdout.flush()
    sys.stderr.flush()
    saved = [os.dup(1), os.dup(2)]
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 1)
        os.dup2(devnull, 2)
        yield
    finally:
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        for fd in (*saved, devnull):
            os.close(fd)


# ------------------------------------------------------------------------------------------------ in the ranks
def memory_per_rank(module: torch.nn.Module, optimizers: list[Any]) -> dict[str, int]:
    """Bytes of parameters (local shards), their ``.grad`` and the optimizers' state tensors held by this rank."""
    params = list({id(p): p for p in module.parameters()}.values())
    state = [t for opt in optimizers for s in opt.state.values() for t in s.values() if torch.is_tensor(t)]
    return {
        "params": sum(local_bytes(p) for p in params),
        "grads": sum(local_bytes(p.grad) for p in params if p.grad is not None),
        "optim": sum(local_bytes(t) for t in state if t.dim() > 0),
    }


class LoopTimer:
    """Times the steps of a plain training loop like ``StepProbe`` times a Trainer's: ``with timer.step(): ...``.

    ``timer.mark("backward")`` / ``timer.mark("optimizer")`` inside a step split it into phases.
    """

    def __init__(self) -> None:
        self.times: list[float] = []
        self.cpu_times: list[float] = []
        self.phases: list[tuple[float, ...]] = []
        self._marks: list[tuple[float, float]] = []

    def mark(self, _phase: str = "") -> None:
        self._marks.append((time.perf_counter(), time.process_time()))

    @contextmanager
    def step(self, timed: bool = True) -> Iterator[None]:
        self._marks = [(time.perf_counter(), time.process_time())]
        yield
        self.mark()
        if timed:
            (t0, c0), (t1, c1) = self._marks[0], self._marks[-1]
            self.times.append(t1 - t0)
            self.cpu_times.append(c1 - c0)
            walls = [b[0] - a[0] for a, b in zip(self._marks, self._marks[1:])]
            cpus = [b[1] - a[1] for a, b in zip(self._marks, self._marks[1:])]
            self.phases.append((*walls, *cpus))

    def result(self) -> dict[str, Any]:
        return {"times": self.times, "cpu_times": self.cpu_times, "phases": self.phases}


def make_step_probe(mem_step: int = 2, profile_step: Optional[int] = None, verbose: bool = False) -> Any:
    """A Lightning callback timing every step like ``LoopTimer`` (phases at ``on_before_backward`` and
    ``on_after_backward``), reading memory at optimizer step ``mem_step`` and profiling the collectives of
    step ``profile_step`` (left out of the timings)."""
    import lightning as L

    class StepProbe(L.Callback):
        def __init__(self) -> None:
            self.timer = LoopTimer()
            self.memory: Optional[dict[str, int]] = None
            self.comm: Optional[dict[str, Any]] = None
            self._step: Any = None
            self._profile: Any = None

        def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
            if trainer.global_step == profile_step:
                self._profile = profiled_collectives(trainer.world_size, verbose)
                self._profile.__enter__()
            self._step = self.timer.step(timed=self._profile is None)
            self._step.__enter__()

        def on_before_backward(self, *args: Any) -> None:
            self.timer.mark("backward")

        def on_after_backward(self, *args: Any) -> None:
            self.timer.mark("optimizer")

        def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
            if trainer.global_step == mem_step and self.memory is None:
                self.memory = memory_per_rank(pl_module, trainer.optimizers)

        def on_train_batch_end(self, *args: Any) -> None:
            self._step.__exit__(None, None, None)
            if self._profile is not None:
                self._profile.__exit__(None, None, None)
                self.comm = self._profile.result
                self._profile = None

        def result(self) -> dict[str, Any]:
            return {**self.timer.result(), "memory": self.memory, "comm": self.comm}

        @property
        def times(self) -> list[float]:
            return self.timer.times

        @property
        def cpu_times(self) -> list[float]:
            return self.timer.cpu_times

        @property
        def phases(self) -> list[tuple[float, ...]]:
            return self.timer.phases

    return StepProbe()


class profiled_collectives:
    """Context manager: the collectives this rank issued inside it (``.result``; see ``probes.collectives_of``).

    Uses ``torch.profiler``, which also sees collectives issued from C++ (DDP's reducer), not only Python calls.
    """

    def __init__(self, world_size: int, verbose: bool = False) -> None:
        self.world_size = world_size
        self.verbose = verbose
        self.result: Optional[dict[str, Any]] = None

    def __enter__(self) -> "profiled_collectives":
        from torch.profiler import ProfilerActivity, profile

        self._profiler = profile(activities=[ProfilerActivity.CPU], record_shapes=True)
        with quiet_fds(not self.verbose):
            self._profiler.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        with quiet_fds(not self.verbose):
            self._profiler.__exit__(*exc)
        self.result = collectives_of(self._profiler, self.world_size)


# ------------------------------------------------------------------------------------------------ the report
def summarize(runs: list[list[dict[str, Any]]], warmup: int) -> dict[str, Any]:
    """Pool a configuration's repeats: per step the slowest rank's wall time and the ranks' mean CPU time."""
    wall, cpu, phases, run_wall, run_cpu = [], [], [], [], []
    for outputs in runs:
        per_step = [max(steps) for steps in zip(*(o["times"] for o in outputs))][warmup:]
        per_cpu = [statistics.mean(steps) for steps in zip(*(o["cpu_times"] for o in outputs))][warmup:]
        wall += per_step
        cpu += per_cpu
        run_wall.append(statistics.median(per_step))
        run_cpu.append(statistics.median(per_cpu))
        phases += [tuple(map(statistics.mean, zip(*s))) for s in zip(*(o.get("phases") or [] for o in outputs))][warmup:]
    first = runs[0]
    memories = [o["memory"] for o in first if o.get("memory")]
    return {
        "memory": max(memories, key=lambda m: sum(v for v in m.values() if isinstance(v, int))) if memories else None,
        "comm": first[0].get("comm"),  # rank 0's, first repeat
        "loss": first[0].get("loss"),
        "median": statistics.median(wall),
        "min": min(wall),
        "cpu": statistics.median(cpu),
        "run_medians": run_wall,
        "run_cpu": run_cpu,
        "phases": [statistics.median(column) for column in zip(*phases)] if phases else [],
    }


def ratio(results: dict[str, dict[str, Any]], name: str, peer: str, key: str = "run_medians") -> tuple[float, float, float]:
    """Median, min and max over repeats of ``name``'s time / ``peer``'s time in the same repeat (interleaved)."""
    pairs = [a / b for a, b in zip(results[name][key], results[peer][key])]
    return statistics.median(pairs), min(pairs), max(pairs)


def ratio_table(results: dict[str, dict[str, Any]], pairs: list[tuple[str, str, Optional[float]]],
                title: str = "") -> list[dict[str, Any]]:
    """Print ``name / peer`` step-time and CPU-time ratios (median of per-repeat ratios [min-max]) and the target.

    ``pairs``: ``(name, peer, target)``; a ratio above ``target`` is flagged ``MISSED``. Returns the rows.
    """
    rows = []
    if title:
        print(title)
    head = f"{'configuration':<22} {'peer':<22} {'step ms':>8} {'peer ms':>8} {'step ratio':>20} {'cpu ratio':>20} {'target':>7}"
    print(head)
    print("-" * len(head))
    for name, peer, target in pairs:
        if name not in results or peer not in results:
            print(f"{name:<22} {peer:<22} (missing)")
            continue
        wall, cpu = ratio(results, name, peer), ratio(results, name, peer, "run_cpu")
        verdict = "" if target is None else ("ok" if wall[0] <= target else "MISSED")
        print(f"{name:<22} {peer:<22} {results[name]['median'] * 1e3:8.1f} {results[peer]['median'] * 1e3:8.1f}"
              f" {_fmt_ratio(wall):>20} {_fmt_ratio(cpu):>20} {'' if target is None else f'<={target:.2f}':>7} {verdict}")
        rows.append({"name": name, "peer": peer, "wall": wall, "cpu": cpu, "target": target})
    return rows


def _fmt_ratio(r: tuple[float, float, float]) -> str:
    return f"{r[0]:.3f} [{r[1]:.2f}-{r[2]:.2f}]"


def fmt_comm(comm: Optional[dict[str, Any]]) -> str:
    """``AR3 RS2 ...``: collectives per kind (logging syncs of one element included)."""
    if not comm:
        return "?"
    return " ".join(f"{kind}{n}" for kind, n in sorted(comm["counts"].items()))


def ring_fraction(world: int) -> float:
    return (world - 1) / world if world > 1 else 0.0


def load_average() -> str:
    try:
        return " ".join(f"{x:.1f}" for x in os.getloadavg())
    except OSError:
        return "?"
