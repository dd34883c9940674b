"""Benchmark ``compile=True``: step time of the demo GPT with each block compiled, against the same run uncompiled.

Each configuration fits the demo GPT under ``HybridStrategy(zero_stage=--zero-stage, compile=...)`` on ``--devices``
forked gloo processes (``--repeats`` interleaved runs); the steps before ``--warmup`` (compilation included) are left
out of the medians. Printed: median step time (slowest rank) and process CPU time, the ratio compiled / uncompiled,
and the final losses (equal to ~1e-4: inductor reorders float ops).
"""

from __future__ import annotations

import argparse
import os
from typing import Any

from benchmarks import demo_gpt
from benchmarks.probes import make_step_probe
from benchmarks.report import table
from benchmarks.run import fit, load_average, run_interleaved, start_rank
from benchmarks.stats import summarize

CONFIGS: dict[str, bool] = {"eager": False, "compiled": True}


def fit_job(name: str, args: dict[str, Any]) -> dict[str, Any]:
    from datetime import timedelta

    from lightning_mgpu import HybridStrategy
    from lightning_mgpu.demo import GPTLightningModule

    start_rank(args["verbose"])
    module = GPTLightningModule(**demo_gpt.gpt_kwargs(args))
    probe = make_step_probe(verbose=args["verbose"])
    strategy = HybridStrategy(zero_stage=args["zero_stage"], compile=CONFIGS[name], timeout=timedelta(seconds=600))
    return fit(
        probe, module, demo_gpt.demo_data(args), devices=args["devices"], strategy=strategy, max_steps=args["steps"]
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--devices", type=int, default=2, help="processes (= data-parallel size) per run")
    parser.add_argument("--zero-stage", type=int, default=0, choices=(0, 1, 2, 3))
    demo_gpt.add_run_args(parser, steps=30, warmup=10, repeats=2, block_size=128)
    args = demo_gpt.parse_run_args(parser, argv)
    demo_gpt.preload()
    jobs = {name: (fit_job, args["devices"], (name, args)) for name in CONFIGS}
    runs = run_interleaved(jobs, args["repeats"], args["timeout"], args["verbose"])
    results = {name: summarize(done, args["warmup"]) for name, done in runs.items()}
    base = results["eager"]
    print(
        f"\ndemo GPT n_layer={args['n_layer']} n_embd={args['n_embd']} block={args['block_size']}, batch"
        f" {args['batch_size']}/rank, {args['devices']} ranks, zero_stage={args['zero_stage']};"
        f" load {load_average()}"
    )
    columns = {
        "step/eager": lambda n, r: f"x{r['median'] / base['median']:.2f}",
        "cpu/eager": lambda n, r: f"x{r['cpu'] / base['cpu']:.2f}",
        "    loss": lambda n, r: f"{r['loss']:.4f}",
    }
    table(results, columns)


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
