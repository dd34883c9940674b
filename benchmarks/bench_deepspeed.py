"""``zero_backend="deepspeed"`` against Lightning's ``DeepSpeedStrategy`` and the torch backend, ZeRO 1-3.

==================  =====================================================================  =======================
configuration       what                                                                   peer (target ratio)
==================  =====================================================================  =======================
``lightning-dsN``   Lightning's ``DeepSpeedStrategy(stage=N)``, its CUDA-only check lifted  -
                    here (this benchmark only) so that it runs on CPU with gloo
``dsN``             ``HybridStrategy(zero_backend="deepspeed", zero_stage=N)``              ``lightning-dsN`` (1.05)
``ds-lzN``          ``dsN`` given Lightning's ZeRO settings (buckets, ``overlap_comm``, ...)    ``lightning-dsN`` (1.05)
                    through ``deepspeed_config``: the same engine config, so the ratio is
                    the strategies' own cost
``torchN``          ``HybridStrategy(zero_stage=N)`` (the torch backend)                    ``dsN`` (informative)
==================  =====================================================================  =======================

All fit the demo GPT on the same data with the same per-rank batch in ``--devices`` forked gloo processes. Every
configuration runs once per repeat, odd repeats in reverse order (ABBA), so that a drift of a shared machine's load
hits both members of a compared pair alike; each ratio is the median over repeats of the per-repeat ratio of
median step times (warm-up steps dropped), for wall time (slowest rank) and process CPU time (mean of ranks) --
on a loaded machine the CPU-time ratio is the steadier one. Step time runs from ``on_train_batch_start`` to
``on_train_batch_end`` (``benchmarks/harness.py``). Memory per rank right after backward is read with
``deepspeed_engine.memory_per_rank`` for both DeepSpeed runs and the harness's probe for the torch backend, and
printed in bytes per parameter beside the ZeRO formulas. The ZeRO settings in which our engine's config and
Lightning's differ are printed last. ``python benchmarks/bench_deepspeed.py [--stages 1,2,3] [--repeats 4]
[--profile DIR]`` (``--profile``: rank 0's timed steps under cProfile, one ``.prof`` per configuration).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from math import nan
from typing import Any, Optional

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import harness  # noqa: E402
from benchmarks.harness import MB, QUIET_TRAINER, SEED  # noqa: E402

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


def _lightning_zero_settings(stage: int) -> dict[str, Any]:
    """The ``zero_optimization`` settings Lightning's DeepSpeedStrategy gives a user who names only the stage."""
    zero = dict(_lightning_deepspeed(stage).config["zero_optimization"])
    zero.pop("stage")
    return zero


def _strategy(name: str) -> Any:
    from lightning_mgpu import HybridStrategy

    stage = int(name[-1])
    if name.startswith("lightning-ds"):
        return _lightning_deepspeed(stage)
    if name.startswith("ds-lz"):  # ours, given Lightning's ZeRO settings: the engine config made equal
        config = {"zero_optimization": _lightning_zero_settings(stage)}
        return HybridStrategy(zero_stage=stage, zero_backend="deepspeed", deepspeed_config=config)
    backend = "deepspeed" if name.startswith("ds") else "torch"
    return HybridStrategy(zero_stage=stage, zero_backend=backend)


def _memory_probe(mem_step: int) -> Any:
    import lightning as L

    class DeepSpeedMemory(L.Callback):
        memory: Optional[dict[str, int]] = None

        def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
            from lightning_mgpu.parallel.deepspeed_engine import memory_per_rank

            if trainer.global_step == mem_step and hasattr(trainer.strategy.model, "optimizer"):
                base = getattr(optimizer, "optimizer", optimizer)  # Lightning hands the DeepSpeed optimizer over
                self.memory = memory_per_rank(trainer.strategy.model, pl_module, base)
                self.memory["numel"] = sum(getattr(p, "ds_numel", p.numel()) for p in pl_module.parameters())

    return DeepSpeedMemory()


def _step_profiler(name: str, args: dict[str, Any]) -> Any:
    """With ``--profile DIR``: global rank 0 runs the timed steps (warm-up left out) under cProfile and writes
    ``DIR/<configuration>.prof`` (of the last repeat), to compare the configurations' calls with ``pstats``."""
    import cProfile

    import lightning as L

    class StepProfiler(L.Callback):
        def __init__(self) -> None:
            self.profile = cProfile.Profile()

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
    harness.quiet_worker(args["verbose"])
    import lightning as L

    from lightning_mgpu.demo import GPTLightningModule, TextDataModule

    L.seed_everything(SEED, verbose=False)
    probe = harness.make_step_probe(args["mem_step"], verbose=args["verbose"])
    memory = _memory_probe(args["mem_step"])
    callbacks = [probe, memory] + ([_step_profiler(name, args)] if args["profile"] else [])
    trainer = L.Trainer(accelerator="cpu", devices=args["devices"], strategy=_strategy(name), max_steps=args["steps"],
                        callbacks=callbacks, **QUIET_TRAINER)
    module = GPTLightningModule(block_size=args["block_size"], n_layer=args["n_layer"], n_head=args["n_head"],
                                n_embd=args["n_embd"], seed=SEED)
    trainer.fit(module, TextDataModule(batch_size=args["batch_size"], block_size=args["block_size"], val_fraction=0.1))
    result = probe.result()
    if memory.memory is not None:
        result["memory"] = memory.memory
    elif result.get("memory"):  # the torch backend: the harness's probe (local shards, their grads, states)
        result["memory"]["numel"] = sum(p.numel() for p in module.parameters())
    config = getattr(trainer.strategy.model, "config", None)  # a DeepSpeed engine's config dict
    result["zero_config"] = dict(config.get("zero_optimization", {})) if isinstance(config, dict) else None
    return {**result, "loss": float(trainer.callback_metrics.get("train_loss", float("nan")))}


# The torch backend's bytes per parameter per rank after backward (fp32 AdamW, no master copy): ZeRO-1 under DDP
# keeps whole parameters and gradients; FSDP2 (ZeRO-2/3) has resharded parameters and gradients by then.
TORCH_BYTES_PER_PARAM = {1: lambda dp: 8 + 8 / dp, 2: lambda dp: 16 / dp, 3: lambda dp: 16 / dp}
KINDS = ("lightning-ds", "ds", "ds-lz", "torch")


def _run_abba(jobs: dict[str, tuple], repeats: int, timeout: float, verbose: bool, warmup: int) -> dict[str, list]:
    """Every configuration once per repeat, odd repeats in reverse order (ABBA): a drift of the shared machine's
    load within a repeat then hits both members of a compared pair alike."""
    runs: dict[str, list] = {name: [] for name in jobs}
    for repeat in range(repeats):
        order = list(jobs) if repeat % 2 == 0 else list(jobs)[::-1]
        order = [name for name in order if repeat == 0 or runs[name]]  # a configuration that failed is not retried
        print(f"-- repeat {repeat + 1}/{repeats}, load average {harness.load_average()}", flush=True)
        done = harness.run_interleaved({name: jobs[name] for name in order}, 1, timeout, verbose,
                                       report=lambda n, o: f"{harness.summarize([o], warmup)['median'] * 1e3:.1f} ms")
        for name, outputs in done.items():
            runs[name] += outputs
    return {name: done for name, done in runs.items() if done}


def _expected_bytes_per_param(name: str, dp: int) -> float:
    from lightning_mgpu.parallel.deepspeed_engine import zero_bytes_per_param

    stage = int(name[-1])
    if name.startswith("torch"):
        return TORCH_BYTES_PER_PARAM[stage](dp)
    return sum(zero_bytes_per_param(stage, dp).values())


def _config_differences(runs: dict[str, list], stage: int) -> str:
    """The ZeRO settings in which our engine's config and Lightning's differ (the rest is equal)."""
    configs = [runs[name][0][0].get("zero_config") if name in runs else None for name in (f"ds{stage}",
                                                                                           f"lightning-ds{stage}")]
    if None in configs:
        return "?"
    ours, theirs = configs
    keys = sorted(k for k in set(ours) | set(theirs) if ours.get(k) != theirs.get(k))
    return ", ".join(f"{k}: {ours.get(k, 'default')} vs {theirs.get(k, 'default')}" for k in keys) or "none"


def main(argv: Optional[list[str]] = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--stages", default="1,2,3")
    parser.add_argument("--steps", type=int, default=25)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=4, help="ABBA-ordered; an even number keeps the order fair")
    parser.add_argument("--n-layer", type=int, default=4)
    parser.add_argument("--n-embd", type=int, default=192)
    parser.add_argument("--n-head", type=int, default=4)
    parser.add_argument("--block-size", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=8, help="per rank")
    parser.add_argument("--mem-step", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=600.0)
    parser.add_argument("--profile", default="", help="directory: cProfile of rank 0's timed steps per configuration")
    parser.add_argument("--verbose", action="store_true")
    ns = parser.parse_args(argv)
    args = vars(ns)
    import deepspeed  # noqa: F401  (imported before forking)
    import lightning  # noqa: F401

    import lightning_mgpu  # noqa: F401

    stages = [int(s) for s in ns.stages.split(",")]
    names = [f"{kind}{stage}" for stage in stages for kind in KINDS]
    jobs = {name: (job, ns.devices, (name, args)) for name in names}
    load_before = harness.load_average()
    runs = _run_abba(jobs, ns.repeats, ns.timeout, ns.verbose, ns.warmup)
    results = {name: harness.summarize(done, ns.warmup) for name, done in runs.items()}
    print(f"\nGPT n_layer={ns.n_layer} n_embd={ns.n_embd}; dp={ns.devices} x batch {ns.batch_size}, gloo;"
          f" {ns.repeats} ABBA-interleaved repeats x {ns.steps - ns.warmup} timed steps; {os.cpu_count()} cores,"
          f" load average {load_before} before, {harness.load_average()} after")
    pairs = [(f"{kind}{s}", f"lightning-ds{s}", TARGET) for s in stages for kind in ("ds", "ds-lz")]
    pairs += [(f"torch{s}", f"ds{s}", None) for s in stages]
    rows = harness.ratio_table(results, pairs)
    for row in rows[:2 * len(stages)]:
        verdicts = [f"{what} {'ok' if row[key][0] <= TARGET else 'MISSED'}" for what, key in (("step", "wall"),
                                                                                             ("CPU", "cpu"))]
        print(f"  {row['name']} vs {row['peer']} (target <= {TARGET}): {', '.join(verdicts)}")
    print(f"\nmemory per rank after backward (step {ns.mem_step}), fp32 AdamW; B/param against the ZeRO formulas")
    print(f"{'configuration':<16} {'step ms':>8} {'cpu ms':>7} {'param MB':>9} {'grad MB':>8} {'optim MB':>9}"
          f" {'B/param':>8} {'formula':>8} {'loss':>7}")
    for name in [n for n in names if n in runs]:
        first = runs[name][0]
        mem = max((o.get("memory") or {} for o in first), key=lambda m: sum(m.values()), default={})
        mems = " ".join(f"{mem.get(k, float('nan')) / MB:>8.3f}" for k in ("params", "grads", "optim"))
        held = sum(mem.get(k, 0) for k in ("params", "grads", "optim")) / mem["numel"] if mem.get("numel") else nan
        print(f"{name:<16} {results[name]['median'] * 1e3:8.1f} {results[name]['cpu'] * 1e3:7.1f}  {mems}"
              f" {held:8.2f} {_expected_bytes_per_param(name, ns.devices):8.2f} {first[0]['loss']:7.4f}")
    print("\nZeRO settings that differ, ours vs Lightning's DeepSpeedStrategy (DeepSpeed's defaults where unset):")
    for stage in stages:
        print(f"  stage {stage}: {_config_differences(runs, stage)}")
    return {"results": results, "rows": rows}


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
