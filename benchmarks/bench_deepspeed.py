"""``zero_backend="deepspeed"`` against Lightning's ``DeepSpeedStrategy`` and the torch backend, ZeRO 1-3.

==================  =====================================================================  =======================
configuration       what                                                                   peer (target ratio)
==================  =====================================================================  =======================
``lightning-dsN``   Lightning's ``DeepSpeedStrategy(stage=N)``, its CUDA-only check lifted  -
                    here (this benchmark only) so that it runs on CPU with gloo
``dsN``             ``HybridStrategy(zero_backend="deepspeed", zero_stage=N)``              ``lightning-dsN`` (1.05)
``torchN``          ``HybridStrategy(zero_stage=N)`` (the torch backend)                    ``dsN`` (informative)
==================  =====================================================================  =======================

All fit the demo GPT on the same data with the same per-rank batch in ``--devices`` forked gloo processes,
interleaved (``benchmarks/harness.py``: step wall/CPU time from ``on_train_batch_start`` to ``on_train_batch_end``);
memory per rank after backward is read with ``deepspeed_engine.memory_per_rank`` for the DeepSpeed runs and the
harness's probe for the torch backend. ``python benchmarks/bench_deepspeed.py [--stages 1,2,3] [--repeats 3]``
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
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


def _strategy(name: str) -> Any:
    from lightning_mgpu import HybridStrategy

    stage = int(name[-1])
    if name.startswith("lightning-ds"):
        return _lightning_deepspeed(stage)
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

    return DeepSpeedMemory()


def job(name: str, args: dict[str, Any]) -> dict[str, Any]:
    harness.quiet_worker(args["verbose"])
    import lightning as L

    from lightning_mgpu.demo import GPTLightningModule, TextDataModule

    L.seed_everything(SEED, verbose=False)
    probe = harness.make_step_probe(args["mem_step"], verbose=args["verbose"])
    memory = _memory_probe(args["mem_step"])
    trainer = L.Trainer(accelerator="cpu", devices=args["devices"], strategy=_strategy(name), max_steps=args["steps"],
                        callbacks=[probe, memory], **QUIET_TRAINER)
    module = GPTLightningModule(block_size=args["block_size"], n_layer=args["n_layer"], n_head=args["n_head"],
                                n_embd=args["n_embd"], seed=SEED)
    trainer.fit(module, TextDataModule(batch_size=args["batch_size"], block_size=args["block_size"], val_fraction=0.1))
    result = probe.result()
    if memory.memory is not None:
        result["memory"] = memory.memory
    return {**result, "loss": float(trainer.callback_metrics.get("train_loss", float("nan")))}


def main(argv: Optional[list[str]] = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--stages", default="1,2,3")
    parser.add_argument("--steps", type=int, default=15)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--n-layer", type=int, default=4)
    parser.add_argument("--n-embd", type=int, default=192)
    parser.add_argument("--n-head", type=int, default=4)
    parser.add_argument("--block-size", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=8, help="per rank")
    parser.add_argument("--mem-step", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=600.0)
    parser.add_argument("--verbose", action="store_true")
    ns = parser.parse_args(argv)
    args = vars(ns)
    import deepspeed  # noqa: F401  (imported before forking)
    import lightning  # noqa: F401

    import lightning_mgpu  # noqa: F401

    stages = [int(s) for s in ns.stages.split(",")]
    names = [f"{kind}{stage}" for stage in stages for kind in ("lightning-ds", "ds", "torch")]
    jobs = {name: (job, ns.devices, (name, args)) for name in names}
    runs = harness.run_interleaved(jobs, ns.repeats, ns.timeout, ns.verbose,
                                   report=lambda n, o: f"{harness.summarize([o], ns.warmup)['median'] * 1e3:.1f} ms")
    results = {name: harness.summarize(done, ns.warmup) for name, done in runs.items()}
    print(f"\nGPT n_layer={ns.n_layer} n_embd={ns.n_embd}; dp={ns.devices} x batch {ns.batch_size}, gloo;"
          f" {ns.repeats} interleaved repeats; load {harness.load_average()}")
    pairs = [(f"ds{s}", f"lightning-ds{s}", TARGET) for s in stages] + [(f"torch{s}", f"ds{s}", None) for s in stages]
    rows = harness.ratio_table(results, pairs)
    print(f"\n{'configuration':<16} {'step ms':>8} {'cpu ms':>7} {'param MB':>9} {'grad MB':>8} {'optim MB':>9}"
          f" {'loss':>7}")
    for name in [n for n in names if n in runs]:
        first = runs[name][0]
        mem = max((o.get("memory") or {} for o in first), key=lambda m: sum(m.values()), default={})
        mems = " ".join(f"{mem.get(k, float('nan')) / MB:>8.3f}" for k in ("params", "grads", "optim"))
        print(f"{name:<16} {results[name]['median'] * 1e3:8.1f} {results[name]['cpu'] * 1e3:7.1f}  {mems}"
              f" {first[0]['loss']:7.4f}")
    return {"results": results, "rows": rows}


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
