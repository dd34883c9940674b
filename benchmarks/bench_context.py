"""Benchmark context parallelism: activation memory per rank against cp, and the longest sequence under a cap.

Each run fits the demo GPT (``lightning_mgpu.demo``: learned positions, causal SDPA) under
``HybridStrategy(context_parallel_size=cp)`` on ``cp`` forked gloo processes, with the same model and per-rank batch,
for each cp of ``--cp`` (default 1, 2, 4) and each sequence length of ``--seq-lens``. Measured on one untimed step
after ``--steps`` (``bench_memory.ActivationProbe``): the bytes of tensors made in forward still alive when backward
starts (the activations autograd keeps, parameters excluded), the largest rank's. Printed:

- activation memory per rank at each sequence length, and its ratio to cp 1 (expected ~1/cp: each rank holds
  ``seq/cp`` tokens and the ring keeps no ``seq x seq`` scores);
- the longest of the measured sequence lengths whose activations stay under ``--cap-mib`` (default: what cp 1 needs
  at the first length), per cp (expected ~cp times longer);
- the step time (median wall, slowest rank) beside it, for the record only: on 2 CPU cores, 4 processes share them.

Run ``python -m benchmarks.bench_context --help`` (from the repository root) for the flags.
"""

from __future__ import annotations

import argparse
import os
from typing import Any

from benchmarks import demo_gpt
from benchmarks.bench_memory import ActivationProbe
from benchmarks.probes import make_step_probe
from benchmarks.report import MB
from benchmarks.run import fit, load_average, run_interleaved, start_rank
from benchmarks.stats import summarize


def fit_job(cp: int, seq_len: int, args: dict[str, Any]) -> dict[str, Any]:
    from datetime import timedelta

    from lightning_mgpu import HybridStrategy
    from lightning_mgpu.demo import GPTLightningModule

    start_rank(args["verbose"])
    sizes = {**args, "block_size": seq_len}
    module = GPTLightningModule(**demo_gpt.gpt_kwargs(sizes))
    steps = args["steps"]
    probe = make_step_probe(probes={steps: lambda trainer: ActivationProbe(module)}, verbose=args["verbose"])
    strategy = HybridStrategy(context_parallel_size=cp, timeout=timedelta(seconds=300))
    result = fit(probe, module, demo_gpt.demo_data(sizes), devices=cp, strategy=strategy, max_steps=steps + 1)
    return {**result, "activations": result["probes"][steps]}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cp", type=str, default="1,2,4", help="context-parallel sizes (one run each)")
    parser.add_argument(
        "--seq-lens", type=str, default="512,960,1024,1920,2048", help="sequence lengths (multiples of 2 cp)"
    )
    parser.add_argument("--cap-mib", type=float, default=None, help="activation memory cap per rank (MiB)")
    demo_gpt.add_run_args(parser, steps=3, warmup=1, repeats=1, block_size=256)
    args = demo_gpt.parse_run_args(parser, argv)
    sizes = [int(cp) for cp in args["cp"].split(",")]
    lengths = [int(seq) for seq in args["seq_lens"].split(",")]
    demo_gpt.preload()
    jobs = {f"cp={cp} seq={seq}": (fit_job, cp, (cp, seq, args)) for cp in sizes for seq in lengths}
    runs = run_interleaved(jobs, args["repeats"], args["timeout"], args["verbose"])
    held = {name: max(rank["activations"]["held"] for rank in done[0]) for name, done in runs.items()}
    steps = {name: summarize(done, args["warmup"])["median"] for name, done in runs.items()}
    print(
        f"\ndemo GPT n_layer={args['n_layer']} n_embd={args['n_embd']} n_head={args['n_head']}, batch"
        f" {args['batch_size']} per data-parallel rank; load {load_average()}"
    )
    print(f"{'seq':>6} " + " ".join(f"{'cp=' + str(cp) + ' MiB':>12} {'x cp=1':>7}" for cp in sizes))
    for seq in lengths:
        base = held[f"cp={sizes[0]} seq={seq}"]
        cells = [f"{held[f'cp={cp} seq={seq}'] / MB:>12.2f} {held[f'cp={cp} seq={seq}'] / base:>7.3f}" for cp in sizes]
        print(f"{seq:>6} " + " ".join(cells))
    cap = args["cap_mib"] * MB if args["cap_mib"] else held[f"cp={sizes[0]} seq={lengths[0]}"]
    print(f"\nlongest measured sequence with activations <= {cap / MB:.2f} MiB per rank:")
    for cp in sizes:
        fitting = [seq for seq in lengths if held[f"cp={cp} seq={seq}"] <= cap]
        step = ", ".join(f"{steps[f'cp={cp} seq={seq}'] * 1e3:.0f}" for seq in lengths)
        print(f"  cp={cp}: {max(fitting) if fitting else 'none'} tokens   (step ms at {args['seq_lens']}: {step})")


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
