"""``zero_backend="deepspeed"`` against Lightning's ``DeepSpeedStrategy`` and the torch backend, ZeRO 1-3.

==================  =====================================================================  =======================
configuration       what                                                                   peer (target ratio)
==================  =====================================================================  =======================
``lightning-dsN``   Lightning's ``DeepSpeedStrategy(stage=N)``, its CUDA-only check lifted  -
                    here (this benchmark only) so that it runs on CPU with gloo
``dsN``             ``HybridStrategy(zero_backend="deepspeed", zero_stage=N)``: without a   ``lightning-dsN`` (1.05)
                    ``deepspeed_config`` its engine gets Lightning's ZeRO settings (buckets,
                    ``overlap_comm``, ...), so the ratio is the strategies' own cost
``ds-ddN``          ``dsN`` with ``deepspeed_config={}``: DeepSpeed's own ZeRO defaults     ``dsN`` (informative)
                    (what a config file that sets none gets)
``torchN``          ``HybridStrategy(zero_stage=N)`` (the torch backend)                    ``dsN`` (informative)
==================  =====================================================================  =======================

All fit the demo GPT on the same data with the same per-rank batch in ``--devices`` forked gloo processes. Every
configuration runs once per repeat, odd repeats in reverse order (ABBA), so that a drift of a shared machine's load
hits both members of a compared pair alike; each ratio is the median over repeats of the per-repeat ratio of
median step times (warm-up steps dropped), for wall time (slowest rank) and process CPU time (mean of ranks) --
on a loaded machine the CPU-time ratio is the steadier one. Step time runs from ``on_train_batch_start`` to
``on_train_batch_end`` (``benchmarks/probes.py``). Memory per rank right after backward is read with
``deepspeed_engine.memory_per_rank`` for both DeepSpeed runs and the shared step probe for the torch backend, and
printed in bytes per parameter beside the ZeRO formulas. The ZeRO settings in which our engines' configs and
Lightning's differ are printed last (``dsN``: none). ``python -m benchmarks.bench_deepspeed [--stages 1,2,3]
[--repeats 4] [--profile DIR]`` (``--profile``: rank 0's timed steps under cProfile, one ``.prof`` per configuration,
timed in the main thread's CPU time, which a shared machine's load does not stretch).
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

from benchmarks import demo_gpt
from benchmarks.probes import make_step_probe
from benchmarks.report import memory_columns, ratio_table, table
from benchmarks.run import fit, load_average, run_interleaved, start_rank
from benchmarks.stats import summarize

TARGET = 1.05  # our DeepSpeed backend's step time over Lightning's DeepSpeedStrategy


def _lightning_deepspeed(stage: int) -> Any:
    """Lightning's DeepSpeedStrategy with its CUDA-only check skipped (it otherwise runs unchanged on CPU)."""
    from lightning.pytorch.strategies import DeepSpeedStrategy
    from lightning.pytorch.strategies.ddp import DDPStrategy

    class CPUDeepSpeedStrategy(DeepSpeedStrategy):
        def setup_environment(self) -> None:
            DDPStrategy.setup_environment(self)

        @property
        def root_device(self) -> Any:  # DeepSpeed is given `device_rank=root_device.index`: CPU has one device
            import torch

            return torch.device("cpu", 0)

        def setup_distributed(self) -> None:  # without the check that every device has a CUDA index
            from lightning.fabric.utilities.seed import reset_seed

            reset_seed()
            self.set_world_ranks()
            self._init_deepspeed_distributed()

    return CPUDeepSpeedStrategy(stage=stage, process_group_backend="gloo", logging_batch_size_per_gpu=1)


def _strategy(name: str) -> Any:
    from lightning_mgpu import HybridStrategy

    stage = int(name[-1])
    if name.startswith("lightning-ds"):
        return _lightning_deepspeed(stage)
    if name.startswith("ds-dd"):  # ours, given a config that sets nothing: DeepSpeed's own defaults
        return HybridStrategy(zero_stage=stage, zero_backend="deepspeed", deepspeed_config={})
    backend = "deepspeed" if name.startswith("ds") else "torch"
    return HybridStrategy(zero_stage=stage, zero_backend=backend)


def _memory_probe(mem_step: int) -> Any:
    import lightning as L

    class DeepSpeedMemory(L.Callback):
        memory: dict[str, int] | None = None
        zero_config: dict[str, Any] | None = None

        def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
            from lightning_mgpu.backends.deepspeed import memory_per_rank

            if trainer.global_step == mem_step and hasattr(trainer.strategy.model, "optimizer"):
                base = getattr(optimizer, "optimizer", optimizer)  # Lightning hands the DeepSpeed optimizer over
                self.memory = memory_per_rank(trainer.strategy.model, pl_module, base)
                self.memory["numel"] = sum(getattr(p, "ds_numel", p.numel()) for p in pl_module.parameters())
                config = trainer.strategy.model.config  # the engine's (ours gives the module back after fit)
                self.zero_config = dict(config.get("zero_optimization", {})) if isinstance(config, dict) else None

    return DeepSpeedMemory()


def _step_profiler(name: str, args: dict[str, Any]) -> Any:
    """With ``--profile DIR``: global rank 0 runs the timed steps (warm-up left out) under cProfile and writes
    ``DIR/<configuration>.prof`` (of the last repeat), to compare the configurations' calls with ``pstats``. Times
    are the main thread's CPU time (waits on the other rank count nothing), steady under a shared machine's load."""
    import cProfile
    import time

    import lightning as L

    class StepProfiler(L.Callback):
        def __init__(self) -> None:
            self.profile = cProfile.Profile(time.thread_time)

        def on_train_batch_start(self, trainer: Any, *rest: Any) -> None:
            if trainer.global_rank == 0 and trainer.global_step >= args["warmup"]:
                self.profile.enable()

        def on_train_batch_end(self, trainer: Any, *rest: Any) -> None:
            self.profile.disable()

        def on_train_end(self, trainer: Any, pl_module: Any) -> None:
            if trainer.global_rank == 0:
                Path(args["profile"]).mkdir(parents=True, exist_ok=True)
                self.profile.dump_stats(str(Path(args["profile"]) / f"{name}.prof"))

    return StepProfiler()


def job(name: str, args: dict[str, Any]) -> dict[str, Any]:
    from lightning_mgpu.demo import GPTLightningModule

    start_rank(args["verbose"])
    probe = make_step_probe(args["mem_step"], verbose=args["verbose"])
    memory = _memory_probe(args["mem_step"])
    callbacks = [probe, memory] + ([_step_profiler(name, args)] if args["profile"] else [])
    module = GPTLightningModule(**demo_gpt.gpt_kwargs(args))
    result = fit(
        probe,
        module,
        demo_gpt.demo_data(args),
        callbacks,
        devices=args["devices"],
        strategy=_strategy(name),
        max_steps=args["steps"],
    )
    if memory.memory is not None:
        result["memory"] = memory.memory
    elif result.get("memory"):  # the torch backend: the step probe's (local shards, their grads, states)
        result["memory"]["numel"] = sum(p.numel() for p in module.parameters())
    return {**result, "zero_config": memory.zero_config}


# The torch backend's bytes per parameter per rank after backward (fp32 AdamW, no master copy): ZeRO-1 under DDP
# keeps whole parameters and gradients; FSDP2 (ZeRO-2/3) has resharded parameters and gradients by then.
TORCH_BYTES_PER_PARAM = {1: lambda dp: 8 + 8 / dp, 2: lambda dp: 16 / dp, 3: lambda dp: 16 / dp}
KINDS = ("lightning-ds", "ds", "ds-dd", "torch")


def _expected_bytes_per_param(name: str, dp: int) -> float:
    from lightning_mgpu.backends.deepspeed import zero_bytes_per_param

    stage = int(name[-1])
    if name.startswith("torch"):
        return TORCH_BYTES_PER_PARAM[stage](dp)
    return sum(zero_bytes_per_param(stage, dp).values())


def _held_per_param(name: str, r: dict[str, Any]) -> str:
    mem = r["memory"] or {}
    return f"{sum(mem.get(k, 0) for k in ('params', 'grads', 'optim')) / mem['numel']:.2f}" if "numel" in mem else "nan"


def _config_differences(runs: dict[str, list], ours: str, theirs: str) -> str:
    """The ZeRO settings in which the engine configs of two configurations differ (the rest is equal)."""
    mine, peer = (runs[name][0][0].get("zero_config") if name in runs else None for name in (ours, theirs))
    if mine is None or peer is None:
        return "?"
    keys = sorted(k for k in set(mine) | set(peer) if mine.get(k) != peer.get(k))
    return ", ".join(f"{k}: {mine.get(k, 'default')} vs {peer.get(k, 'default')}" for k in keys) or "none"


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--stages", default="1,2,3")
    demo_gpt.add_run_args(parser, steps=25, warmup=5, repeats=4)
    parser.add_argument("--mem-step", type=int, default=2)
    parser.add_argument("--profile", default="", help="directory: cProfile of rank 0's timed steps per configuration")
    args = demo_gpt.parse_run_args(parser, argv)
    demo_gpt.preload("deepspeed")
    stages = [int(s) for s in args["stages"].split(",")]
    names = [f"{kind}{stage}" for stage in stages for kind in KINDS]
    load_before = load_average()
    jobs = {name: (job, args["devices"], (name, args)) for name in names}
    runs = run_interleaved(jobs, args["repeats"], args["timeout"], args["verbose"], abba=True)
    results = {name: summarize(done, args["warmup"]) for name, done in runs.items()}
    print(
        f"\nGPT n_layer={args['n_layer']} n_embd={args['n_embd']}; dp={args['devices']} x batch {args['batch_size']},"
        f" gloo; {args['repeats']} ABBA-interleaved repeats x {args['steps'] - args['warmup']} timed steps;"
        f" {os.cpu_count()} cores, load average {load_before} before, {load_average()} after"
    )
    pairs: list[tuple[str, str, float | None]] = [(f"ds{s}", f"lightning-ds{s}", TARGET) for s in stages]
    pairs += [(f"{kind}{s}", f"ds{s}", None) for s in stages for kind in ("ds-dd", "torch")]
    rows = ratio_table(results, pairs)
    columns = {
        "B/param": _held_per_param,
        "formula": lambda n, r: f"{_expected_bytes_per_param(n, args['devices']):.2f}",
    }
    table(
        results,
        {**memory_columns(3), **columns, "   loss": lambda n, r: f"{r['loss']:.4f}"},
        title=f"\nmemory per rank after backward (step {args['mem_step']}), fp32 AdamW; B/param: vs formula",
    )
    print("\nZeRO settings that differ from Lightning's DeepSpeedStrategy's (DeepSpeed's defaults where unset):")
    for stage in stages:
        for ours in (f"ds{stage}", f"ds-dd{stage}"):
            print(f"  {ours}: {_config_differences(runs, ours, f'lightning-ds{stage}')}")
    return {"results": results, "rows": rows}


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
