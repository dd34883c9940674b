"""Running the configurations: each a job in its own set of forked gloo processes, and what a rank does first.

Every per-topic script (``bench_*.py``) is a list of configurations, each a job run in its own set of forked gloo
processes (``tests/helpers/distributed.run_distributed``). This module runs them the same way for all of them, so
that a ratio means the same in every table:

- ``run_interleaved``: every configuration once per repeat, the repeats interleaved (``abba``: every other repeat
  reversed), so that a slow drift of a shared machine hits every configuration alike; one failing configuration
  prints one line and does not hide the others (``run_or_report``).
- in a rank: ``start_rank`` (logs quiet, seeded as every run is) and ``fit`` (``Trainer.fit`` with the quiet
  settings of ``QUIET_TRAINER``); ``quiet_fds`` silences the raw stdout/stderr descriptors (kineto, torchao).

Timing is ``timing.py``'s, what a rank reads around its steps ``probes.py``'s, the pooling of repeats ``stats.py``'s
and the tables ``report.py``'s. Beside them: ``demo_gpt.py`` (the command line, the seeded demo module, its data in
Lightning's order), ``collectives.py`` (collectives by phase and module against an analytic expectation) and
``by_hand.py`` (the peers written by hand: the tensor-parallel plan and FSDP2 in ``configure_model``).
"""

from __future__ import annotations

import logging
import os
import statistics
import sys
import time
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from tests.helpers.distributed import run_distributed

SEED = 1234
# Every benchmark Trainer: on CPU; no logger, checkpoints, progress bar, summary or validation beside the steps.
QUIET_TRAINER: dict[str, Any] = dict(
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
    jobs: dict[str, tuple[Callable[..., Any], int, tuple[Any, ...]]],
    repeats: int,
    timeout: float = 300.0,
    verbose: bool = False,
    report: Callable[[str, list[Any]], str] | None = None,
    abba: bool = False,
    repeats_of: dict[str, int] | None = None,
) -> dict[str, list[Any]]:
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


def load_average() -> str:
    try:
        return " ".join(f"{x:.1f}" for x in os.getloadavg())
    except OSError:
        return "?"


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
