"""The shared benchmark harness: launch a configuration, time its steps, probe memory and collectives, print ratios.

Every per-topic script (``bench_*.py``) is a list of configurations, each a job run in its own set of forked gloo
processes (``tests/helpers/distributed.run_distributed``), plus its own analytic expectations. The harness does the
rest the same way for all of them, so that a ratio means the same in every table:

- ``run_interleaved``: every configuration once per repeat, the repeats interleaved (``abba``: every other repeat
  reversed), so that a slow drift of a shared machine hits every configuration alike; one failing configuration
  prints one line and does not hide the others.
- ``make_step_probe`` (a Lightning callback) and ``LoopTimer`` (for plain loops): wall time and process CPU time per
  step (``on_train_batch_start`` -> ``on_train_batch_end``, or the same work in a loop), split into forward /
  backward / optimizer step, and from one step's start to the next (``iter``); memory and sharding per rank right
  after backward (``memory_per_rank``, ``sharding``); the collectives of one extra, untimed step
  (``profiled_collectives``), and any other context manager around an untimed step (``probes``, told the phase).
- ``summarize``: per step the slowest rank, warm-up steps dropped, repeats pooled; ``ratio_table``: each
  configuration against its peer, the median of the per-repeat ratios with their range (the spread of the noise);
  ``table``: one row per configuration with a script's own columns.

Beside it: ``demo_gpt.py`` (the command line, the seeded demo module, its data in Lightning's order),
``collectives.py`` (collectives by phase and module against an analytic expectation) and ``by_hand.py`` (the peers
written by hand: the tensor-parallel plan and FSDP2 in ``configure_model``).
"""

from __future__ import annotations

import logging
import math
import os
import statistics
import sys
import time
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

import torch  # noqa: E402

from tests.helpers.distributed import run_distributed  # noqa: E402
from tests.helpers.probes import collectives_of, local_bytes  # noqa: E402

SEED = 1234
MB = 2**20
# Every benchmark Trainer: on CPU; no logger, checkpoints, progress bar, summary or validation beside the steps.
QUIET_TRAINER = dict(
    accelerator="cpu",
    logger=False,
    enable_checkpointing=False,
    enable_progress_bar=False,
    enable_model_summary=False,
    num_sanity_val_steps=0,
    limit_val_batches=0,
)


# ------------------------------------------------------------------------------------------------ launching
def run_or_report(
    name: str, job: Callable[..., Any], nprocs: int, *args: Any, timeout: float = 300.0, verbose: bool = False
) -> list[Any] | None:
    """``job(*args)`` on ``nprocs`` forked ranks; on failure print one line (all with ``verbose``), return None."""
    try:
        return run_distributed(job, nprocs, *args, timeout=timeout)
    except Exception as err:
        print(f"{name}: FAILED: {str(err).strip().splitlines()[-1]}", flush=True)
        if verbose:
            print(err)
        return None


def run_interleaved(
    jobs: dict[str, tuple[Callable[..., Any], int, tuple]],
    repeats: int,
    timeout: float = 300.0,
    verbose: bool = False,
    report: Callable[[str, list[Any]], str] | None = None,
    abba: bool = False,
    repeats_of: dict[str, int] | None = None,
) -> dict[str, list]:
    """Run ``{name: (job, nprocs, args)}`` ``repeats`` times, interleaved; returns ``{name: [outputs per repeat]}``.

    ``report(name, outputs)`` makes the progress line printed after each run (default: the median step time).
    ``abba``: odd repeats run in reverse order, so that a drift of the machine's load within a repeat hits both
    members of a compared pair alike. ``repeats_of``: ``{name: repeats}`` for configurations that run more repeats
    than ``repeats`` (a cheap pair whose ratio swings more per repeat than its margin); give both members of a pair
    the same count, so their repeats stay matched.
    """
    counts = {name: (repeats_of or {}).get(name, repeats) for name in jobs}
    total = max(counts.values(), default=0)
    runs: dict[str, list[list[Any]]] = {name: [] for name in jobs}
    for repeat in range(total):
        if total > 1:
            print(f"-- repeat {repeat + 1}/{total}, load average {load_average()}", flush=True)
        for name in list(jobs)[::-1] if abba and repeat % 2 else list(jobs):
            if repeat >= counts[name]:
                continue
            job, nprocs, args = jobs[name]
            if repeat and not runs[name]:
                continue  # failed before
            t0 = time.perf_counter()
            outputs = run_or_report(name, job, nprocs, *args, timeout=timeout, verbose=verbose)
            if outputs is None:
                continue
            runs[name].append(outputs)
            line = report(name, outputs) if report else _median_line(outputs)
            print(f"[{repeat + 1}/{counts[name]}] {name}: {line} ({time.perf_counter() - t0:.1f} s job)", flush=True)
    return {name: done for name, done in runs.items() if done}


def _median_line(outputs: list[Any]) -> str:
    steps = [max(step) for step in zip(*(o["times"] for o in outputs))] if outputs[0].get("times") else []
    return f"{statistics.median(steps) * 1e3:.1f} ms/step (median, warm-up included)" if steps else ""


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
def start_rank(verbose: bool) -> None:
    """First thing in a rank: logs quiet (unless ``verbose``), seeded as every run is (``PL_GLOBAL_SEED`` included:
    Lightning seeds its ``DistributedSampler`` with it)."""
    import lightning as L

    quiet_worker(verbose)
    L.seed_everything(SEED, verbose=False)


def fit(probe: Any, module: Any, datamodule: Any, callbacks: list[Any] | None = None, **trainer: Any) -> dict[str, Any]:
    """``Trainer(**trainer).fit`` in this rank with the quiet settings (``callbacks`` default: ``[probe]``); the
    probe's result and the last logged ``train_loss``."""
    import lightning as L

    fitted = L.Trainer(callbacks=callbacks or [probe], **QUIET_TRAINER, **trainer)
    fitted.fit(module, datamodule)
    return {**probe.result(), "loss": float(fitted.callback_metrics.get("train_loss", float("nan")))}


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


def make_step_probe(
    mem_step: int = 2,
    profile_step: int | None = None,
    verbose: bool = False,
    probes: dict[int, Callable[[Any], Any]] | None = None,
    ops: bool = False,
) -> Any:
    """A Lightning callback timing every step like ``LoopTimer`` (phases at ``on_before_backward`` and
    ``on_after_backward``), reading memory and sharding at optimizer step ``mem_step`` and profiling the
    collectives of step ``profile_step`` (``ops``: also the op counts), left out of the timings.

    ``probes``: ``{step: factory(trainer)}`` of more context managers, each run around its step (untimed; told the
    phase like ``LoopTimer.step(probe=...)``); their ``.result`` land in ``result()["probes"][step]``.
    """
    import lightning as L

    factories = dict(probes or {})
    if profile_step is not None:
        factories[profile_step] = lambda trainer: profiled_collectives(trainer.world_size, verbose, ops)

    class StepProbe(L.Callback):
        def __init__(self) -> None:
            self.timer = LoopTimer()
            self.memory: dict[str, int] | None = None
            self.sharding: list[tuple[str, str, tuple[int, ...]]] | None = None
            self.probed: dict[int, Any] = {}
            self._step: Any = None
            self._probe: Any = None

        def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
            factory = factories.get(trainer.global_step)
            self._probe = (trainer.global_step, factory(trainer)) if factory else None
            self._step = self.timer.step(probe=self._probe[1] if self._probe else None)
            self._step.__enter__()

        def on_before_backward(self, *args: Any) -> None:
            self.timer.mark("backward")

        def on_after_backward(self, *args: Any) -> None:
            self.timer.mark("optimizer")

        def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
            if trainer.global_step == mem_step and self.memory is None:
                self.memory = memory_per_rank(pl_module, trainer.optimizers)
                self.sharding = sharding(pl_module)

        def on_train_batch_end(self, *args: Any) -> None:
            self._step.__exit__(None, None, None)
            if self._probe is not None:
                self.probed[self._probe[0]] = self._probe[1].result

        def result(self) -> dict[str, Any]:
            comm = self.probed.get(profile_step) if profile_step is not None else None
            return {
                **self.timer.result(),
                "memory": self.memory,
                "sharding": self.sharding,
                "comm": comm,
                "probes": self.probed,
            }

    return StepProbe()


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


def sharding(module: torch.nn.Module) -> list[tuple[str, str, tuple[int, ...]]]:
    """(name, placements, local shape) per parameter: to compare runs' sharding."""
    from torch.distributed.tensor import DTensor

    return [
        (name, str(tuple(p.placements)), tuple(p.to_local().shape))
        if isinstance(p, DTensor)
        else (name, "plain", tuple(p.shape))
        for name, p in module.named_parameters()
    ]


class profiled_collectives:
    """Context manager: the collectives this rank issued inside it (``.result``; see ``probes.collectives_of``).

    Uses ``torch.profiler``, which also sees collectives issued from C++ (DDP's reducer), not only Python calls.
    ``ops``: also ``result["ops"]``, the count and self CPU ms of every op.
    """

    def __init__(self, world_size: int, verbose: bool = False, ops: bool = False) -> None:
        self.world_size = world_size
        self.verbose = verbose
        self.ops = ops
        self.result: dict[str, Any] | None = None

    def __enter__(self) -> profiled_collectives:
        from torch.profiler import ProfilerActivity, profile

        self._profiler = profile(activities=[ProfilerActivity.CPU], record_shapes=True)
        with quiet_fds(not self.verbose):
            self._profiler.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        with quiet_fds(not self.verbose):
            self._profiler.__exit__(*exc)
        self.result = collectives_of(self._profiler, self.world_size)
        if self.ops:  # {op: (count, self CPU ms)}
            averages = self._profiler.key_averages()
            self.result["ops"] = {e.key: (e.count, e.self_cpu_time_total / 1e3) for e in averages}


# ------------------------------------------------------------------------------------------------ the report
PROFILED_NOTE = (
    "NOTE: --profile runs the timed steps under cProfile, which slows Python-heavy code (Lightning's loop, DTensor"
    " dispatch) far more than kernels: the ratios of this run are not comparable; compare calls, and time without it."
)


def summarize(runs: list[list[dict[str, Any]]], warmup: int) -> dict[str, Any]:
    """Pool a configuration's repeats: per step the slowest rank's wall time and the ranks' mean CPU time.

    ``median``/``cpu`` (and ``iter``/``iter_cpu`` where the probe had them: start to next start) over all repeats;
    ``run_medians``/``run_cpu`` (``run_iter``/``run_iter_cpu``) per repeat, for ``ratio``; ``rank0``: global rank
    0's output of the first repeat, for what a script returns beside the timings.
    """
    first = runs[0]
    memories = [o["memory"] for o in first if o.get("memory")]
    out: dict[str, Any] = {
        "memory": max(memories, key=lambda m: sum(v for v in m.values() if isinstance(v, int))) if memories else None,
        "comm": first[0].get("comm"),
        "loss": first[0].get("loss"),
        "rank0": first[0],
    }
    for wall_key, cpu_key, name, cpu_name in (
        ("times", "cpu_times", "median", "cpu"),
        ("iter_times", "iter_cpu_times", "iter", "iter_cpu"),
    ):
        if not all(o.get(wall_key) for outputs in runs for o in outputs):
            continue
        per_run = [
            (
                [max(s) for s in zip(*(o[wall_key] for o in outputs))][warmup:],
                [statistics.mean(s) for s in zip(*(o[cpu_key] for o in outputs))][warmup:],
            )
            for outputs in runs
        ]
        out[name] = statistics.median(w for wall, _ in per_run for w in wall)
        out[cpu_name] = statistics.median(c for _, cpu in per_run for c in cpu)
        out[f"run_{'medians' if name == 'median' else name}"] = [statistics.median(wall) for wall, _ in per_run]
        out[f"run_{cpu_name}"] = [statistics.median(cpu) for _, cpu in per_run]
        if name == "median":
            out["min"] = min(w for wall, _ in per_run for w in wall)
    if all(o.get("thread_times") for outputs in runs for o in outputs):
        per_run_thread = [
            [statistics.mean(s) for s in zip(*(o["thread_times"] for o in outputs))][warmup:] for outputs in runs
        ]
        out["thread"] = statistics.median(t for run in per_run_thread for t in run)
        out["run_thread"] = [statistics.median(run) for run in per_run_thread]
    phases = [
        tuple(map(statistics.mean, zip(*s)))
        for outputs in runs
        if all(len(o.get("phases") or []) == len(o["times"]) for o in outputs)
        for s in list(zip(*(o["phases"] for o in outputs)))[warmup:]
    ]
    out["phases"] = [statistics.median(column) for column in zip(*phases)] if phases else []
    return out


def ratio(
    results: dict[str, dict[str, Any]], name: str, peer: str, key: str = "run_medians"
) -> tuple[float, float, float]:
    """Median, min and max over repeats of ``name``'s time / ``peer``'s time in the same repeat (interleaved)."""
    pairs = repeat_ratios(results, name, peer, key)
    return statistics.median(pairs), min(pairs), max(pairs)


def repeat_ratios(results: dict[str, dict[str, Any]], name: str, peer: str, key: str = "run_medians") -> list[float]:
    """``name``'s time / ``peer``'s time in each repeat (the same repeat: interleaved)."""
    return [a / b for a, b in zip(results[name][key], results[peer][key])]


def ratio_table(
    results: dict[str, dict[str, Any]], pairs: list[tuple[str, str, float | None]], title: str = "", span: str = "step"
) -> list[dict[str, Any]]:
    """Print ``name / peer`` step-time and CPU-time ratios (median of per-repeat ratios [min-max]) and the target.

    ``pairs``: ``(name, peer, target)``; a step or CPU ratio above ``target`` is flagged ``MISSED``.
    ``span="iter"``: the times from one step's start to the next instead of the step's own. Returns the rows.
    """
    rows = []
    key, wall_key, cpu_key = (
        ("median", "run_medians", "run_cpu") if span == "step" else ("iter", "run_iter", "run_iter_cpu")
    )
    if title:
        print(title)
    head = (
        f"{'configuration':<22} {'peer':<22} {span + ' ms':>8} {'peer ms':>8} {span + ' ratio':>20}"
        f" {'cpu ratio':>20} {'target':>7}"
    )
    print(head)
    print("-" * len(head))
    for name, peer, target in pairs:
        if name not in results or peer not in results:
            print(f"{name:<22} {peer:<22} (missing)")
            continue
        wall, cpu = ratio(results, name, peer, wall_key), ratio(results, name, peer, cpu_key)
        verdict = (
            ""
            if target is None
            else ", ".join(f"{what} {'ok' if r[0] <= target else 'MISSED'}" for what, r in ((span, wall), ("cpu", cpu)))
        )
        print(
            f"{name:<22} {peer:<22} {results[name][key] * 1e3:8.1f} {results[peer][key] * 1e3:8.1f}"
            f" {_fmt_ratio(wall):>20} {_fmt_ratio(cpu):>20} {'' if target is None else f'<={target:.2f}':>7} {verdict}"
        )
        rows.append({"name": name, "peer": peer, "wall": wall, "cpu": cpu, "target": target})
    return rows


def thread_table(results: dict[str, dict[str, Any]], pairs: list[tuple[str, str, float | None]]) -> None:
    """Supplementary to ``ratio_table``: the ratio of the ranks' main-thread CPU time per step (median over repeats
    [min-max]). Process CPU time also counts gloo's worker threads, whose polling while a rank waits for its peer
    varies with the machine's load from run to run; the main thread's is the work the rank's step itself did."""
    print("\nmain-thread CPU time per step (the rank's own work, no gloo worker thread), ours / peer:")
    for name, peer, _ in pairs:
        if "run_thread" in results.get(name, {}) and "run_thread" in results.get(peer, {}):
            r = ratio(results, name, peer, "run_thread")
            ms = results[name]["thread"] * 1e3, results[peer]["thread"] * 1e3
            print(f"  {name:<22} {peer:<22} {ms[0]:8.1f} {ms[1]:8.1f} {_fmt_ratio(r):>20}")


CONFIDENCE = 0.95  # of the intervals `interval_table` prints
DECIDES = 0.9  # the least coverage from which an interval decides a target (5 repeats give 93.8%)


def median_interval(values: list[float], confidence: float = CONFIDENCE) -> tuple[float, float, float]:
    """A distribution-free interval for the median of ``values``: the order statistics ``x(k)`` and ``x(n+1-k)`` with
    the largest ``k`` whose coverage (a binomial sum, no assumption on the distribution) is at least ``confidence``.
    Returns ``(low, high, coverage)``; with too few values for ``confidence``, the min and max and their coverage.
    E.g. 15 values: the 4th and 12th smallest, 96.5%; 5 values: the min and max, 93.8%."""
    ordered, n = sorted(values), len(values)
    interval = (ordered[0], ordered[-1], 1 - 2 * 0.5**n)
    for k in range(2, (n + 1) // 2 + 1):
        coverage = 1 - 2 * sum(math.comb(n, i) for i in range(k)) / 2**n
        if coverage < confidence:
            break
        interval = (ordered[k - 1], ordered[n - k], coverage)
    return interval


def interval_table(results: dict[str, dict[str, Any]], pairs: list[tuple[str, str, float | None]]) -> None:
    """For each pair with a target: where the median of its per-repeat ratios lies (``median_interval``), step and
    CPU, and whether this run decides the target: ``met`` (the interval lies below it), ``missed`` (above it) or
    ``undecided`` (it holds the target: another run of the same code may land on either side); below 90% coverage
    (4 repeats or fewer), ``too few repeats``."""
    rows = [(name, peer, target) for name, peer, target in pairs if target is not None]
    rows = [row for row in rows if row[0] in results and row[1] in results]
    if not rows:
        return
    print(f"\nwhere each median lies ({CONFIDENCE:.0%} interval over the repeats' ratios), and what it decides:")
    for name, peer, target in rows:
        cells = []
        for what, key in (("step", "run_medians"), ("cpu", "run_cpu")):
            low, high, coverage = median_interval(repeat_ratios(results, name, peer, key))
            verdict = "met" if high <= target else "missed" if low > target else "undecided"
            verdict = verdict if coverage >= DECIDES else "too few repeats"
            cells.append(f"{what} [{low:.3f}-{high:.3f}] ({coverage:.1%}) {verdict}")
        print(f"  {name:<22} {peer:<22} <={target:.2f}: " + ", ".join(cells))


def table(
    results: dict[str, dict[str, Any]],
    columns: dict[str, Callable[[str, dict[str, Any]], str]],
    title: str = "",
    phases: bool = False,
) -> None:
    """One row per configuration: median step and CPU ms, then ``columns`` (``{header: cell(name, result)}``);
    ``phases``: then forward / backward / optimizer ms per configuration, wall and CPU."""
    if title:
        print(title)
    head = f"{'configuration':<22} {'step ms':>8} {'cpu ms':>7} " + " ".join(columns)
    print(head + "\n" + "-" * len(head))
    for name, r in results.items():
        cells = " ".join(f"{cell(name, r):>{len(header)}}" for header, cell in columns.items())
        print(f"{name:<22} {r['median'] * 1e3:8.1f} {r['cpu'] * 1e3:7.1f} {cells}")
    if phases:
        print("phases, ms (median over steps of the ranks' mean), wall then CPU: forward / backward / optimizer step")
        for name, r in results.items():
            ph = [f"{x * 1e3:.1f}" for x in r["phases"]]
            print(f"  {name:<22} wall {'/'.join(ph[:3]):<18} cpu {'/'.join(ph[3:])}")


def memory_columns(digits: int = 2) -> dict[str, Callable[[str, dict[str, Any]], str]]:
    """``table`` columns: MB per rank of parameters, gradients and optimizer state (the most loaded rank)."""
    return {
        f"{k[:5]} MB": lambda n, r, k=k: f"{r['memory'][k] / MB:.{digits}f}" if r["memory"] else "-"
        for k in ("params", "grads", "optim")
    }


def _fmt_ratio(r: tuple[float, float, float]) -> str:
    return f"{r[0]:.3f} [{r[1]:.2f}-{r[2]:.2f}]"


def fmt_comm(comm: dict[str, Any] | None) -> str:
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
