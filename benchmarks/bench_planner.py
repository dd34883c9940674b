"""Benchmark the planner's step-time model on this machine: predicted (after ``--calibrate``-style measurements)
against measured step times of eight layouts, and the rank correlation of the two orders.

Every layout fits the demo GPT with Lightning's ``Trainer`` and ``HybridStrategy`` in its own set of forked gloo
processes (``tests/helpers/distributed.run_distributed``) with the same model, data, seed and global batch; the
layouts are those whose memory ``tests/test_planner.py`` checks (ZeRO 0-3, tensor and pipeline parallel, at 2 and 4
processes). Measured per step: wall time ``on_train_batch_start`` -> ``on_train_batch_end`` and process CPU time of
the same span, the slowest rank, median over the steps after ``--warmup``. Predicted: ``planner.estimate`` on the
machine as ``lightning_mgpu.planner.calibrate.measure`` sees it (one-process FLOP/s of the real module, memory
bandwidth, gloo latency and bandwidth; processes beyond the cores share them).

Run ``python benchmarks/bench_planner.py --help`` for the flags.
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import sys
import time
import warnings
from pathlib import Path
from typing import Any, Optional

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

import torch  # noqa: E402, F401  (imported before forking: each job's start is fast)

from benchmarks.bench_zero import QUIET_TRAINER, run_or_report  # noqa: E402
from tests.test_planner import MEASURED_BATCH, MEASURED_GPT, MEASURED_LAYOUTS  # noqa: E402

SEED = 1234


def fit_job(kwargs: dict[str, Any], batch: int, steps: int) -> dict[str, Any]:
    warnings.filterwarnings("ignore")
    for name in ("lightning", "lightning.pytorch", "lightning.fabric", "torch.distributed"):
        logging.getLogger(name).setLevel(logging.ERROR)
    from datetime import timedelta

    import lightning as L

    from lightning_mgpu import HybridStrategy
    from lightning_mgpu.demo import GPTLightningModule, TextDataModule

    class Timer(L.Callback):
        def __init__(self) -> None:
            self.wall: list[float] = []
            self.cpu: list[float] = []

        def on_train_batch_start(self, *args: Any) -> None:
            self._wall, self._cpu = time.perf_counter(), time.process_time()

        def on_train_batch_end(self, *args: Any) -> None:
            self.wall.append(time.perf_counter() - self._wall)
            self.cpu.append(time.process_time() - self._cpu)

    L.seed_everything(SEED, verbose=False)
    timer = Timer()
    trainer = L.Trainer(accelerator="cpu", devices=int(os.environ["WORLD_SIZE"]),
                        strategy=HybridStrategy(timeout=timedelta(seconds=120), **kwargs), max_steps=steps,
                        callbacks=[timer], **QUIET_TRAINER)
    dp = trainer.strategy.layout.data_parallel_size  # type: ignore[attr-defined]
    trainer.fit(GPTLightningModule(**MEASURED_GPT, seed=SEED),
                TextDataModule(batch_size=batch // dp, block_size=MEASURED_GPT["block_size"]))
    return {"wall": timer.wall, "cpu": timer.cpu}


def spearman(a: list[float], b: list[float]) -> float:
    def ranks(xs: list[float]) -> list[int]:
        order = sorted(range(len(xs)), key=xs.__getitem__)
        out = [0] * len(xs)
        for r, i in enumerate(order):
            out[i] = r
        return out

    ra, rb, n = ranks(a), ranks(b), len(a)
    return 1 - 6 * sum((x - y) ** 2 for x, y in zip(ra, rb)) / (n * (n * n - 1))


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--timeout", type=float, default=300)
    args = parser.parse_args(argv)

    from lightning_mgpu.demo import GPTLightningModule
    from lightning_mgpu.planner import Training, estimate, spec_from_module
    from lightning_mgpu.planner.calibrate import measure
    from lightning_mgpu.planner.search import layout_from_options

    module = GPTLightningModule(**MEASURED_GPT)
    spec = spec_from_module(module)
    machine = measure(spec, module)
    training = Training(global_batch=MEASURED_BATCH, precision="32-true")
    rows = []
    for processes, kwargs in MEASURED_LAYOUTS:
        outputs = run_or_report(str(kwargs), fit_job, processes, kwargs, MEASURED_BATCH, args.steps,
                                timeout=args.timeout, verbose=False)
        if outputs is None:
            continue
        wall = statistics.median([max(s) for s in zip(*(o["wall"] for o in outputs))][args.warmup:])
        cpu = statistics.median([max(s) for s in zip(*(o["cpu"] for o in outputs))][args.warmup:])
        cluster, efficiency = machine.as_cluster(processes)
        layout = layout_from_options(processes, MEASURED_BATCH, **kwargs)
        predicted = estimate(spec, cluster, training, layout, efficiency).time["step"]
        rows.append((processes, kwargs, wall, cpu, predicted))
        print(f"{processes} processes {kwargs}: wall {wall * 1e3:.1f} ms, cpu {cpu * 1e3:.1f} ms,"
              f" predicted {predicted * 1e3:.1f} ms", flush=True)
    print()
    print(machine.as_cluster(2)[1].source)
    print(f"{'layout':<56} {'wall ms':>8} {'cpu ms':>8} {'pred ms':>8}")
    for processes, kwargs, wall, cpu, predicted in rows:
        name = f"{processes} processes " + ", ".join(f"{k}={v}" for k, v in kwargs.items())
        print(f"{name:<56} {wall * 1e3:>8.1f} {cpu * 1e3:>8.1f} {predicted * 1e3:>8.1f}")
    if len(rows) > 2:
        predicted = [r[4] for r in rows]
        print(f"Spearman(predicted, wall) = {spearman(predicted, [r[2] for r in rows]):.2f};"
              f" Spearman(predicted, cpu) = {spearman(predicted, [r[3] for r in rows]):.2f} (target >= 0.8)")


if __name__ == "__main__":
    main()
