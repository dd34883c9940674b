"""Every layout against its peer, side by side in one interleaved run: ZeRO 0-3, tensor and pipeline parallelism.

=====================  =======================================================================  ====================
configuration          what                                                                     peer (target ratio)
=====================  =======================================================================  ====================
``ddp``                Lightning ``DDPStrategy``                                                -
``zero0``              ``HybridStrategy(zero_stage=0)``                                          ``ddp`` (<= 1.00)
``deepspeed-zero1/2``  DeepSpeed ZeRO-1/2: ``deepspeed.initialize`` by hand in a plain loop      -
                       (Lightning's ``DeepSpeedStrategy`` refuses CPU), the module's own AdamW
``zero1``, ``zero2``   ``HybridStrategy(zero_stage=1|2)``                                        ``deepspeed-zero1|2``
                                                                                                 (<= 0.97)
``fsdp2``              Lightning ``ModelParallelStrategy``, ``fully_shard`` per block then the   -
                       root by hand in ``configure_model`` (FSDP2's defaults)
``zero3``              ``HybridStrategy(zero_stage=3)``                                          ``fsdp2`` (<= 1.00)
``mp-tp2``             Lightning ``ModelParallelStrategy``, the tp plan by hand in               -
                       ``configure_model`` (``by_hand.parallelize_by_hand``; FSDP2 over dp
                       if ``--devices`` > 2)
``tp2``                ``HybridStrategy(tensor_parallel_size=2)`` (ZeRO-3 over dp if > 1)        ``mp-tp2`` (<= 1.00)
``pp-hand``            1F1B by hand: ``PipelineStage`` + ``Schedule1F1B`` over stages cut like   -
                       HybridStrategy's (``bench_pipeline.run_by_hand``), pp 2 x dp
                       ``--devices``/2 (FSDP2 ``replicate`` when dp > 1), AdamW fused as ours
``pp-1f1b``            ``HybridStrategy(pipeline_parallel_size=2, data_parallel_size=devices/2,  ``pp-hand`` (<= 1.05)
                       pipeline_schedule="1F1B", num_microbatches=4)``
=====================  =======================================================================  ====================

Every configuration fits the demo GPT on the same data with the same per-rank batch in ``--devices`` forked gloo
processes; steps are timed by the shared step probe (``benchmarks/probes.py``: wall and CPU time of
``on_train_batch_start`` -> ``on_train_batch_end``, the same span in the DeepSpeed loop), memory per rank is read
right after backward, and the collectives of one extra, untimed step are counted from the profiler, with the
bytes a rank sends (ring algorithms) beside the analytic minimum of ``analytic_comm``.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

from benchmarks import by_hand, demo_gpt
from benchmarks.probes import make_step_probe, memory_per_rank, profiled_collectives
from benchmarks.report import (
    MB,
    fmt_comm,
    interval_table,
    memory_columns,
    outside_table,
    ratio_table,
    table,
    thread_table,
)
from benchmarks.run import fit, load_average, quiet_fds, run_interleaved, start_rank
from benchmarks.stats import summarize
from benchmarks.timing import PROFILED_NOTE, LoopTimer, StepProfile
from tests.helpers.probes import local_bytes

PIPELINE_PAIR = ("pp-hand", "pp-1f1b")  # run --pipeline-repeats times
PP = 2  # pipeline stages of `pp-hand`/`pp-1f1b`; the other processes are data-parallel replicas of the pipeline

# name -> (kind, options, peer, target)
CONFIGS: dict[str, tuple[str, dict[str, Any], str | None, float | None]] = {
    "ddp": ("ddp", {}, None, None),
    "zero0": ("hybrid", {"zero_stage": 0}, "ddp", 1.00),
    "deepspeed-zero1": ("deepspeed", {"stage": 1}, None, None),
    "zero1": ("hybrid", {"zero_stage": 1}, "deepspeed-zero1", 0.97),
    "deepspeed-zero2": ("deepspeed", {"stage": 2}, None, None),
    "zero2": ("hybrid", {"zero_stage": 2}, "deepspeed-zero2", 0.97),
    "fsdp2": ("fsdp2", {"zero_stage": 3}, None, None),
    "zero3": ("hybrid", {"zero_stage": 3}, "fsdp2", 1.00),
    "mp-tp2": ("mp-tp", {}, None, None),
    "tp2": ("hybrid-tp", {}, "mp-tp2", 1.00),
    "pp-hand": ("pp-hand", {}, None, None),
    "pp-1f1b": ("pp", {}, "pp-hand", 1.05),
}


def analytic_comm(name: str, dp: int, n_params: int, n_root: int) -> tuple[float, str]:
    """The fewest bytes a rank must send per step for gradients and parameters (fp32, ring collectives)."""
    kind, options, _, _ = CONFIGS[name]
    if kind.startswith(("mp-tp", "hybrid-tp", "pp")):
        return 0.0, "see bench_tensor.py / bench_pipeline.py"
    f, full = (dp - 1) / dp, 4 * n_params
    stage = options.get("zero_stage", options.get("stage", 0))
    if kind == "ddp" or stage == 0:
        return 2 * f * full, "AR grads 2(dp-1)/dp*4N"
    if stage in (1, 2):
        return 2 * f * full, "grads reduced to their shard (RS volume) + params gathered (AG volume) 2(dp-1)/dp*4N"
    # ZeRO-3: blocks gathered in forward and again in backward, the root (embeddings, head) once.
    return 2 * f * full + f * 4 * (n_params - n_root), "AG fwd + AG bwd (blocks) + RS"


# ------------------------------------------------------------------------------------------------ in the ranks
def _module(kind: str, args: dict[str, Any]) -> Any:
    from lightning_mgpu.demo import GPTLightningModule

    if kind in ("fsdp2", "mp-tp"):  # by hand in configure_model: FSDP2 over dp, the tp plan over tp
        return by_hand.by_hand_module(demo_gpt.gpt_kwargs(args))
    return GPTLightningModule(**demo_gpt.gpt_kwargs(args))


def _strategy(kind: str, options: dict[str, Any], devices: int) -> Any:
    from datetime import timedelta

    from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy

    from lightning_mgpu import HybridStrategy

    if kind == "ddp":
        return DDPStrategy(process_group_backend="gloo", timeout=timedelta(seconds=120))
    if kind in ("fsdp2", "mp-tp"):
        tp = 2 if kind == "mp-tp" else 1
        return ModelParallelStrategy(data_parallel_size=devices // tp, tensor_parallel_size=tp)
    if kind == "hybrid-tp":
        return HybridStrategy(
            tensor_parallel_size=2, data_parallel_size=devices // 2, zero_stage=3 if devices > 2 else 0
        )
    if kind == "pp":
        return HybridStrategy(
            pipeline_parallel_size=PP,
            data_parallel_size=devices // PP,
            pipeline_schedule="1F1B",
            num_microbatches=2 * PP,
        )
    return HybridStrategy(data_parallel_size=devices, **options)


def _step_profile(name: str, args: dict[str, Any]) -> StepProfile:
    """With ``--profile DIR``: global rank 0's timed steps (warm-up and the probed last step left out) under
    cProfile, written to ``DIR/<configuration>.prof`` (the last repeat's) for ``pstats``; the same for every
    configuration, Trainer or plain loop."""
    path = Path(args["profile"]) / f"{name}.prof" if args["profile"] else None
    return StepProfile(path, range(args["warmup"], args["steps"]))


def trainer_job(name: str, args: dict[str, Any]) -> dict[str, Any]:
    """One Trainer fit of configuration ``name`` in this rank."""
    kind, options, _, _ = CONFIGS[name]
    start_rank(args["verbose"])
    probe = make_step_probe(args["mem_step"], profile_step=args["steps"], verbose=args["verbose"])
    strategy = _strategy(kind, options, args["devices"])
    return fit(
        probe,
        _module(kind, args),
        demo_gpt.demo_data(args),
        [probe, _step_profile(name, args).callback()],
        devices=args["devices"],
        strategy=strategy,
        max_steps=args["steps"] + 1,
    )


def deepspeed_job(name: str, args: dict[str, Any]) -> dict[str, Any]:
    """DeepSpeed ZeRO-1/2 in a plain loop: the same module, optimizer, batches and per-step logging all-reduce."""
    import deepspeed
    import torch
    import torch.distributed as dist

    start_rank(args["verbose"])
    with quiet_fds(not args["verbose"]):
        deepspeed.init_distributed(dist_backend="gloo", verbose=False)
    module = _module("deepspeed", args)
    optimizer = module.configure_optimizers()
    config = {
        "train_micro_batch_size_per_gpu": args["batch_size"],
        "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": CONFIGS[name][1]["stage"]},
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }
    with quiet_fds(not args["verbose"]):
        engine, _, _, _ = deepspeed.initialize(model=module, optimizer=optimizer, config=config)
    data = demo_gpt.demo_data(args)
    data.setup()
    profile = profiled_collectives(dist.get_world_size(), args["verbose"])
    timer, memory, loss, cprofile = LoopTimer(), None, torch.zeros(()), _step_profile(name, args)
    for step, batch in zip(range(args["steps"] + 1), demo_gpt.lightning_order(data.train_dataset, args["batch_size"])):
        cprofile.start(step)
        with timer.step(probe=profile if step == args["steps"] else None):
            loss = module._loss(batch)
            reported = loss.detach().clone()
            dist.all_reduce(reported)  # what `self.log(..., sync_dist=True)` costs the Trainer runs
            timer.mark("backward")
            engine.backward(loss)
            timer.mark("optimizer")
            if step == args["mem_step"]:
                memory = _deepspeed_memory(engine, optimizer)
            engine.step()
        cprofile.stop()
    cprofile.dump()
    return {**timer.result(), "memory": memory, "comm": profile.result, "loss": float(loss)}


def pipeline_by_hand_job(name: str, args: dict[str, Any]) -> dict[str, Any]:
    """The same 1F1B schedule by hand (``bench_pipeline.run_by_hand``) on the same layout, microbatches and per-rank
    batch, timed over the same span as the Trainer's and profiled the same way."""
    start_rank(args["verbose"])
    import torch.distributed as dist

    from benchmarks.bench_pipeline import run_by_hand

    dist.init_process_group("gloo")
    dp = args["devices"] // PP
    return run_by_hand("1F1B", 2 * PP, PP, dp, args, args["batch_size"], _step_profile(name, args))


def _deepspeed_memory(engine: Any, optimizer: Any) -> dict[str, int]:
    """DeepSpeed keeps fp32 gradients/partitions in its own flat buffers: count what the engine holds."""
    import torch

    memory = memory_per_rank(engine.module, [optimizer])
    inner = getattr(engine, "optimizer", None)
    for attribute in ("averaged_gradients", "single_partition_of_fp32_groups"):
        value = getattr(inner, attribute, None)
        items = list(value.values()) if isinstance(value, dict) else value or []
        flat = [t for item in items for t in (item if isinstance(item, list) else [item])]
        memory["grads"] += sum(local_bytes(t) for t in flat if isinstance(t, torch.Tensor))
    return memory


def _job(name: str) -> Any:
    return {"deepspeed": deepspeed_job, "pp-hand": pipeline_by_hand_job}.get(CONFIGS[name][0], trainer_job)


# ------------------------------------------------------------------------------------------------ the report
def _count_params(args: dict[str, Any]) -> tuple[int, int]:
    import torch

    from lightning_mgpu.demo import GPT, GPTConfig

    with torch.device("meta"):
        gpt = GPT(GPTConfig(**{k: v for k, v in demo_gpt.gpt_kwargs(args).items() if k != "seed"}))
    total = sum(p.numel() for p in gpt.parameters())
    return total, total - sum(p.numel() for p in gpt.transformer.h.parameters())


def print_report(runs: dict[str, list], args: dict[str, Any]) -> dict[str, Any]:
    dp, n_params, n_root = args["devices"], *_count_params(args)
    results = {name: summarize(done, args["warmup"]) for name, done in runs.items()}
    print(
        f"\nGPT n_layer={args['n_layer']} n_embd={args['n_embd']} block={args['block_size']}: N={n_params:,}"
        f" ({4 * n_params / MB:.2f} MB fp32); dp={dp} x batch {args['batch_size']}, gloo; {args['repeats']} interleaved"
        f" repeats ({args['pipeline_repeats']} of the pipeline pair) x {args['steps'] - args['warmup']} timed steps;"
        f" load {load_average()}"
    )
    if args["profile"]:
        print(PROFILED_NOTE)
    if dp > (os.cpu_count() or dp):
        print(
            f"{dp} processes share {os.cpu_count()} cores: each repeat's ratio swings by several percent (up to ~10%"
            " on a shared 2-core VM), so a median near its target can land on either side; compare the CPU ratios"
            " over several runs or raise --repeats."
        )
    pairs = [(name, peer, target) for name, (_, _, peer, target) in CONFIGS.items() if peer and name in results]
    rows = ratio_table(results, pairs)
    thread_table(results, pairs)
    outside_table(results, pairs)
    interval_table(results, pairs)
    minimum = {name: analytic_comm(name, dp, n_params, n_root)[0] for name in results}
    mb = lambda value: f"{value / MB:.2f}" if value else "-"
    comm = {"MB/step": lambda n, r: mb(r["comm"] and r["comm"]["bytes"]), "minimum": lambda n, r: mb(minimum[n])}
    table(
        results,
        {**memory_columns(), **comm, "collectives/step": lambda n, r: fmt_comm(r["comm"])},
        title="\nper configuration: memory per rank, bytes sent per step",
        phases=True,
    )
    print("\nstep ratio / cpu ratio: median over repeats of (time / peer's time in the same repeat) [min-max].")
    print("param/grad/optim: MB per rank after backward (most loaded rank); MB/step: bytes rank 0 sends per step")
    print(
        "  for the collectives it issued (ring algorithms, profiler count); minimum: "
        + "; ".join(f"{n} {analytic_comm(n, dp, n_params, n_root)[1]}" for n in ("zero0", "zero1", "zero3"))
    )
    return {"results": results, "rows": rows}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--devices", type=int, default=2, help="processes (= data-parallel size)")
    demo_gpt.add_run_args(parser, repeats=5)  # the pipeline pair: --pipeline-repeats (its margin is the smallest)
    parser.add_argument("--mem-step", type=int, default=2)
    parser.add_argument("--only", default="", help=f"comma-separated subset of {','.join(CONFIGS)}")
    parser.add_argument("--profile", default="", help="directory: cProfile of rank 0's timed steps per configuration")
    parser.add_argument(
        "--pipeline-repeats",
        type=int,
        default=None,
        help="repeats of the pipeline pair (pp-hand, pp-1f1b; default 3 x --repeats): its jobs take seconds, and its"
        " ratio swings ~10%% per repeat against a ~2-3%% distance to its target",
    )
    args = demo_gpt.parse_run_args(parser, argv)
    names = demo_gpt.select(parser, args["only"], CONFIGS)
    if args["pipeline_repeats"] is None:
        args["pipeline_repeats"] = 3 * args["repeats"]
    if args["pipeline_repeats"] < 1:
        parser.error("--pipeline-repeats must be >= 1")
    halved = [n for n in names if CONFIGS[n][0] in ("mp-tp", "hybrid-tp", "pp-hand", "pp")]
    if halved and args["devices"] % 2:
        parser.error(f"{', '.join(halved)} run tp 2 or pp 2 x dp devices/2: --devices must be even")
    demo_gpt.preload()
    jobs = {name: (_job(name), args["devices"], (name, args)) for name in names}
    # ABBA: every other repeat runs in reverse, so a peer and its configuration alternate which runs first.
    pipeline = {name: args["pipeline_repeats"] for name in PIPELINE_PAIR if name in jobs}
    runs = run_interleaved(jobs, args["repeats"], args["timeout"], args["verbose"], abba=True, repeats_of=pipeline)
    return print_report(runs, args)


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
