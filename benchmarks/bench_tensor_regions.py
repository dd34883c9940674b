"""Tensor parallelism: the global-shape (DTensor region) path against the local-tensor path, on the same model.

``tp_plan="auto"`` runs the attention and MLP of a model that is not a Hugging Face one as *global-shape regions*
(``lightning_mgpu/parallel/tensor/region.py``): the column-parallel projections hand back DTensors with the
unsharded shapes, so code that reshapes with global sizes works unchanged. The local path hands each rank its plain
shard instead, which only code written for shards survives. Both run here on the demo GPT
(``lightning_mgpu.demo``), whose attention reads its width from the projection's output and so runs either way:

==========  ======================================================================================================
``global``  ``HybridStrategy(tensor_parallel_size=tp)``, ``tp_plan="auto"``: global-shape regions
``local``   the same strategy with a callable ``tp_plan``: ``parallel.tensor.sharding(..., "auto")`` with no region
            (plain shards, as Hugging Face models get them), the attentions' head counts localized
==========  ======================================================================================================

Each size (``--sizes tp x n_embd``) runs both configurations in ``tp`` forked gloo processes, interleaved over
``--repeats`` (``benchmarks/run.py``): step time (slowest rank, median after warm-up), CPU time, and the
collectives of one extra untimed step (profiler count).

    python -m benchmarks.bench_tensor_regions                 # tp2 x n_embd 64, tp4 x n_embd 256
    python -m benchmarks.bench_tensor_regions --sizes 4x512 --repeats 5
"""

from __future__ import annotations

import argparse
import os
from typing import Any

from benchmarks import demo_gpt
from benchmarks.probes import make_step_probe
from benchmarks.report import fmt_comm, ratio_table, table
from benchmarks.run import fit, load_average, run_interleaved, start_rank
from benchmarks.stats import summarize

PATHS = ("global", "local")


def _local_plan(module: Any, tp_mesh: Any) -> None:
    """``tp_plan="auto"`` exactly, with no global-shape region: every projection hands its plain shard to the code
    (as for a Hugging Face model), and the attentions' head counts are localized for it (the demo GPT reads them)."""
    from torch import nn

    from lightning_mgpu.parallel.tensor import sharding as tensor  # an ablation: patches the private region choice

    regions = tensor._regions

    def all_local(module: nn.Module, matched: dict[str, str]) -> tuple[dict[str, str], dict[str, str]]:
        global_shapes, local = regions(module, matched)
        return {}, {**global_shapes, **local}

    tensor._regions = all_local
    try:
        tensor.apply(module, tp_mesh, "auto", sequence_parallel=False)
    finally:
        tensor._regions = regions
    for block in module.model.transformer.h:
        block.attn.n_head //= tp_mesh.size()
        block.attn.n_embd //= tp_mesh.size()


def trainer_job(path: str, tp: int, n_embd: int, args: dict[str, Any]) -> dict[str, Any]:
    """One Trainer fit of the demo GPT under tp=``tp`` on the ``path`` path, in this rank."""
    from lightning_mgpu import HybridStrategy
    from lightning_mgpu.demo import GPTLightningModule

    start_rank(args["verbose"])
    module = GPTLightningModule(**demo_gpt.gpt_kwargs({**args, "n_embd": n_embd}))
    plan = "auto" if path == "global" else _local_plan
    probe = make_step_probe(mem_step=1, profile_step=args["steps"], verbose=args["verbose"])
    strategy = HybridStrategy(tensor_parallel_size=tp, tp_plan=plan)
    return fit(probe, module, demo_gpt.demo_data(args), devices=tp, strategy=strategy, max_steps=args["steps"] + 1)


def _name(path: str, tp: int, n_embd: int) -> str:
    return f"tp{tp}x{n_embd}-{path}"


def print_report(runs: dict[str, list], sizes: list[tuple[int, int]], args: dict[str, Any]) -> list[dict[str, Any]]:
    results = {name: summarize(done, args["warmup"]) for name, done in runs.items()}
    print(
        f"\ndemo GPT n_layer={args['n_layer']} n_head={args['n_head']} block={args['block_size']} batch"
        f" {args['batch_size']}, gloo; {args['repeats']} interleaved repeats x {args['steps'] - args['warmup']}"
        f" timed steps; load {load_average()}"
    )
    pairs = [(_name("global", tp, e), _name("local", tp, e), None) for tp, e in sizes]
    rows = ratio_table(results, pairs)
    columns = {
        "final loss": lambda n, r: f"{r['loss']:.4f}",
        "collectives/step": lambda n, r: fmt_comm(r["comm"]),
    }
    table(results, columns, title="\nper configuration")
    print("\nstep ratio / cpu ratio: global-shape path / local path in the same repeat, median [min-max].")
    print("collectives: AR all-reduce, AG all-gather, RS reduce-scatter (the logging all-reduce of the loss included).")
    return rows


def _sizes(text: str) -> list[tuple[int, int]]:
    sizes = []
    for item in text.split(","):
        tp, _, n_embd = item.strip().partition("x")
        sizes.append((int(tp), int(n_embd)))
    return sizes


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="2x64,4x256", help="comma-separated TPxN_EMBD (processes x width)")
    demo_gpt.add_run_args(parser, n_embd=None)
    args = demo_gpt.parse_run_args(parser, argv)
    ns = argparse.Namespace(**args)
    sizes = _sizes(ns.sizes)
    bad = [f"{tp}x{e}" for tp, e in sizes if tp < 2 or ns.n_head % tp or e % ns.n_head]
    if bad:
        parser.error(f"--sizes {bad}: tp must be >= 2 and divide --n-head={ns.n_head}, which must divide n_embd")
    demo_gpt.preload()

    jobs = {_name(path, tp, e): (trainer_job, tp, (path, tp, e, args)) for tp, e in sizes for path in PATHS}
    runs = run_interleaved(jobs, ns.repeats, ns.timeout, ns.verbose)
    return print_report(runs, sizes, args)


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
