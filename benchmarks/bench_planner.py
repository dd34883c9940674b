"""Benchmark the planner's step-time model on this machine: predicted (after ``plan --calibrate``'s measurements)
against measured step times of ten layouts, and the rank correlation of the two orders.

Every layout fits the demo GPT with Lightning's ``Trainer`` and ``HybridStrategy`` in its own set of forked gloo
processes (``tests/helpers/equivalence.fit``) with the same model, data, seed and global batch; the layouts are those
``tests/test_planner.py`` checks (ZeRO 0-3, tensor and pipeline parallel, mixes, at 2 and 4 processes). Measured per
step: wall time ``on_train_batch_start`` -> ``on_train_batch_end`` and process CPU time of the same span, the slowest
rank, median over the steps after ``--warmup``. Predicted: ``planner.estimate`` on the machine as
``lightning_mgpu.planner.calibrate.measure`` saw it just before (dispatch cost and FLOP/s of the real module, what
tensor parallelism and FSDP2 add, gloo latency and bandwidth, the cores and other jobs' load), at each layout's own
number of processes; "work" is the prediction before the slowdown of sharing the cores, to set beside CPU time.

Run ``python -m benchmarks.bench_planner --help`` (from the repository root) for the flags.
"""

from __future__ import annotations

import argparse
import os

import torch  # noqa: F401  (imported before forking: each job's start is fast)

from tests.test_planner import (
    MEASURED_BATCH,
    MEASURED_GPT,
    MEASURED_LAYOUTS,
    StepTimer,
    planner_layout,
    spearman,
    step_medians,
)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    args = parser.parse_args(argv)

    from lightning_mgpu.demo import GPTLightningModule, TextDataModule
    from lightning_mgpu.planner import Training, estimate, spec_from_module
    from lightning_mgpu.planner.calibrate import measure
    from tests.helpers.equivalence import fit

    vocab = TextDataModule(batch_size=1, block_size=MEASURED_GPT["block_size"]).vocab_size
    module = GPTLightningModule(**MEASURED_GPT, vocab_size=vocab)
    spec = spec_from_module(module)
    machine = measure(spec, module, processes=max(p for p, _ in MEASURED_LAYOUTS))
    training = Training(global_batch=MEASURED_BATCH, precision="32-true")
    rows = []
    for processes, kwargs in MEASURED_LAYOUTS:
        dp = processes // (kwargs.get("tensor_parallel_size", 1) * kwargs.get("pipeline_parallel_size", 1))
        try:
            _, extras = fit(
                lambda: GPTLightningModule(**MEASURED_GPT),
                lambda dp=dp: TextDataModule(batch_size=MEASURED_BATCH // dp, block_size=MEASURED_GPT["block_size"]),
                kwargs,
                processes,
                args.steps,
                callbacks_factory=lambda: [StepTimer()],
            )
        except Exception as error:  # noqa: BLE001 - one failed layout is reported, the others still run
            print(f"{processes} processes {kwargs}: FAILED: {str(error).strip().splitlines()[-1]}", flush=True)
            continue
        wall, cpu = step_medians(extras, args.warmup)
        cluster, efficiency = machine.as_cluster(processes)
        predicted = estimate(spec, cluster, training, planner_layout(processes, kwargs), efficiency).time["step"]
        rows.append((processes, kwargs, wall, cpu, predicted, predicted / cluster.contention, os.getloadavg()[0]))
    print()
    print(machine.as_cluster(4)[1].source)
    print("| layout | measured wall ms | predicted ms | measured CPU ms | predicted work ms | load |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for processes, kwargs, wall, cpu, predicted, work, load in rows:
        name = f"{processes} processes, " + ", ".join(f"{k}={v}" for k, v in kwargs.items())
        print(
            f"| {name} | {wall * 1e3:.1f} | {predicted * 1e3:.1f} | {cpu * 1e3:.1f} | {work * 1e3:.1f} | {load:.1f} |"
        )
    if len(rows) > 2:
        print(
            f"Spearman(predicted, wall) = {spearman([r[4] for r in rows], [r[2] for r in rows]):.2f};"
            f" Spearman(predicted work, CPU) = {spearman([r[5] for r in rows], [r[3] for r in rows]):.2f}"
            " (target >= 0.8)"
        )


if __name__ == "__main__":
    main()
