"""Every layout against its peer, side by side in one interleaved run: ZeRO 0-3, tensor and pipeline parallelism.

=====================  =======================================================================  ====================
configuration          what                                                                     peer (target ratio)
=====================  =======================================================================  ====================
``ddp``                Lightning ``DDPStrategy``                                                -
``zero0``              ``HybridStrategy(zero_stage=0)``                                          ``ddp`` (<= 1.00)
``deepspeed-zero1/2``  DeepSpeed ZeRO-1/2: ``deepspeed.initialize`` by hand in a plain loop      -
                       (Lightning's ``DeepSpeedStrategy`` refuses CPU), the module's own AdamW
``zero1``, ``zero2``   ``HybridStrategy(zero_stage=1|2)``                                        ``deepspeed-zero1|2`` (<= 0.97)
``fsdp2``              Lightning ``ModelParallelStrategy``, ``fully_shard`` per block then the   -
                       root by hand in ``configure_model`` (FSDP2's defaults)
``zero3``              ``HybridStrategy(zero_stage=3)``                                          ``fsdp2`` (<= 1.00)
``mp-tp2``             Lightning ``ModelParallelStrategy``, the tp plan by hand in               -
                       ``configure_model`` (``bench_tensor.parallelize_by_hand``; FSDP2 over dp
                       if ``--devices`` > 2)
``tp2``                ``HybridStrategy(tensor_parallel_size=2)`` (ZeRO-3 over dp if > 1)        ``mp-tp2`` (<= 1.00)
``pp-hand``            1F1B by hand: ``PipelineStage`` + ``Schedule1F1B`` over stages cut like   -
                       HybridStrategy's (``bench_pipeline._run_hand``), pp = ``--devices``
``pp-1f1b``            ``HybridStrategy(pipeline_parallel_size=devices, pipeline_schedule=       ``pp-hand`` (<= 1.05)
                       "1F1B", num_microbatches=2*pp)``
=====================  =======================================================================  ====================

Every configuration fits the demo GPT on the same data with the same per-rank batch in ``--devices`` forked gloo
processes; steps are timed by the harness's probe (``benchmarks/harness.py``: wall and CPU time of
``on_train_batch_start`` -> ``on_train_batch_end``, the same span in the DeepSpeed loop), memory per rank is read
right after backward, and the collectives of one extra, untimed step are counted from the profiler, with the
bytes a rank sends (ring algorithms) beside the analytic minimum of ``analytic_comm``.
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

# name -> (kind, options, peer, target)
CONFIGS: dict[str, tuple[str, dict[str, Any], Optional[str], Optional[float]]] = {
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
        return 2 * f * full, "RS grads + AG params 2(dp-1)/dp*4N"
    # ZeRO-3: blocks gathered in forward and again in backward, the root (embeddings, head) once.
    return 2 * f * full + f * 4 * (n_params - n_root), "AG fwd + AG bwd (blocks) + RS"


# ------------------------------------------------------------------------------------------------ in the ranks
def _module(kind: str, args: dict[str, Any]) -> Any:
    from lightning_mgpu.demo import GPTLightningModule

    kwargs = dict(block_size=args["block_size"], n_layer=args["n_layer"], n_head=args["n_head"], n_embd=args["n_embd"],
                  seed=SEED)
    if kind == "mp-tp":
        return _tensor_parallel_by_hand(kwargs)
    if kind != "fsdp2":
        return GPTLightningModule(**kwargs)

    class FSDP2ByHand(GPTLightningModule):
        """The demo module with FSDP2 applied by hand, as Lightning's ModelParallelStrategy docs do it."""

        def configure_model(self) -> None:
            from torch.distributed.fsdp import fully_shard

            mesh = self.device_mesh["data_parallel"]
            for block in self.model.transformer.h:
                fully_shard(block, mesh=mesh)
            fully_shard(self.model, mesh=mesh)

    return FSDP2ByHand(**kwargs)


def _tensor_parallel_by_hand(kwargs: dict[str, Any]) -> Any:
    from benchmarks.bench_tensor import parallelize_by_hand
    from lightning_mgpu.demo import GPTLightningModule

    class TensorParallelByHand(GPTLightningModule):
        """The demo module with the tp plan (and FSDP2 over dp) applied by hand, as Lightning's docs do it."""

        def configure_model(self) -> None:
            from torch.distributed.fsdp import fully_shard

            parallelize_by_hand(self.model, self.device_mesh["tensor_parallel"], False)
            dp_mesh = self.device_mesh["data_parallel"]
            if dp_mesh.size() > 1:
                for block in self.model.transformer.h:
                    fully_shard(block, mesh=dp_mesh)
                fully_shard(self.model, mesh=dp_mesh)

    return TensorParallelByHand(**kwargs)


def _strategy(kind: str, options: dict[str, Any], devices: int) -> Any:
    from datetime import timedelta

    if kind == "ddp":
        from lightning.pytorch.strategies import DDPStrategy

        return DDPStrategy(process_group_backend="gloo", timeout=timedelta(seconds=120))
    if kind == "fsdp2":
        from lightning.pytorch.strategies import ModelParallelStrategy

        return ModelParallelStrategy(data_parallel_size=devices, tensor_parallel_size=1)
    if kind == "mp-tp":
        from lightning.pytorch.strategies import ModelParallelStrategy

        return ModelParallelStrategy(data_parallel_size=devices // 2, tensor_parallel_size=2)
    from lightning_mgpu import HybridStrategy

    if kind == "hybrid-tp":
        return HybridStrategy(tensor_parallel_size=2, data_parallel_size=devices // 2,
                              zero_stage=3 if devices > 2 else 0)
    if kind == "pp":
        return HybridStrategy(pipeline_parallel_size=devices, data_parallel_size=1, pipeline_schedule="1F1B",
                              num_microbatches=2 * devices)

    return HybridStrategy(data_parallel_size=devices, **options)


def _datamodule(args: dict[str, Any]) -> Any:
    from lightning_mgpu.demo import TextDataModule

    return TextDataModule(batch_size=args["batch_size"], block_size=args["block_size"], val_fraction=0.1)


def trainer_job(name: str, args: dict[str, Any]) -> dict[str, Any]:
    """One Trainer fit of configuration ``name`` in this rank."""
    harness.quiet_worker(args["verbose"])
    import lightning as L

    kind, options, _, _ = CONFIGS[name]
    L.seed_everything(SEED, verbose=False)
    probe = harness.make_step_probe(args["mem_step"], profile_step=args["steps"], verbose=args["verbose"])
    trainer = L.Trainer(accelerator="cpu", devices=args["devices"], strategy=_strategy(kind, options, args["devices"]),
                        max_steps=args["steps"] + 1, callbacks=[probe], **QUIET_TRAINER)
    trainer.fit(_module(kind, args), _datamodule(args))
    return {**probe.result(), "loss": float(trainer.callback_metrics.get("train_loss", float("nan")))}


def deepspeed_job(name: str, args: dict[str, Any]) -> dict[str, Any]:
    """DeepSpeed ZeRO-1/2 in a plain loop: the same module, optimizer, batches and per-step logging all-reduce."""
    harness.quiet_worker(args["verbose"])
    import deepspeed
    import lightning as L
    import torch
    import torch.distributed as dist
    from torch.utils.data import DataLoader, DistributedSampler

    _, options, _, _ = CONFIGS[name]
    L.seed_everything(SEED, verbose=False)
    with harness.quiet_fds(not args["verbose"]):
        deepspeed.init_distributed(dist_backend="gloo", verbose=False)
    module = _module("deepspeed", args)
    optimizer = module.configure_optimizers()
    config = {
        "train_micro_batch_size_per_gpu": args["batch_size"],
        "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": options["stage"]},
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }
    with harness.quiet_fds(not args["verbose"]):
        engine, _, _, _ = deepspeed.initialize(model=module, optimizer=optimizer, config=config)
    dm = _datamodule(args)
    dm.setup()
    # Lightning substitutes DistributedSampler(shuffle=True) for the Trainer runs: the same order here.
    sampler = DistributedSampler(dm.train_dataset, shuffle=True, seed=0)
    loader = iter(DataLoader(dm.train_dataset, batch_size=args["batch_size"], sampler=sampler))
    timer, memory, comm, loss = harness.LoopTimer(), None, None, torch.zeros(())
    for step in range(args["steps"] + 1):
        batch = next(loader)
        profile = harness.profiled_collectives(dist.get_world_size(), args["verbose"]) if step == args["steps"] else None
        if profile:
            profile.__enter__()
        with timer.step(timed=profile is None):
            loss = module._loss(batch)
            reported = loss.detach().clone()
            dist.all_reduce(reported)  # what `self.log(..., sync_dist=True)` costs the Trainer runs
            timer.mark("backward")
            engine.backward(loss)
            timer.mark("optimizer")
            if step == args["mem_step"]:
                memory = _deepspeed_memory(engine, optimizer)
            engine.step()
        if profile:
            profile.__exit__(None, None, None)
            comm = profile.result
    return {**timer.result(), "memory": memory, "comm": comm, "loss": float(loss)}


def pipeline_by_hand_job(name: str, args: dict[str, Any]) -> dict[str, Any]:
    """The same 1F1B schedule by hand (``bench_pipeline._run_hand``), timed over the same span as the Trainer's."""
    harness.quiet_worker(args["verbose"])
    import torch.distributed as dist

    from benchmarks.bench_pipeline import _Recorder, _run_hand

    dist.init_process_group("gloo")
    pp = args["devices"]
    run = _run_hand("1F1B", 2 * pp, {**args, "pp": pp, "steps": args["steps"]}, _Recorder())
    steps = run["steps"]
    return {"times": [s["wall"] for s in steps], "cpu_times": [s["cpu"] for s in steps], "phases": [],
            "memory": None, "comm": None, "loss": steps[-1]["loss"]}


def _deepspeed_memory(engine: Any, optimizer: Any) -> dict[str, int]:
    """DeepSpeed keeps fp32 gradients/partitions in its own flat buffers: count what the engine holds."""
    memory = harness.memory_per_rank(engine.module, [optimizer])
    inner = getattr(engine, "optimizer", None)
    flat = [t for name in ("averaged_gradients", "single_partition_of_fp32_groups") for t in _tensors(inner, name)]
    memory["grads"] += sum(harness.local_bytes(t) for t in flat if t is not None)
    return memory


def _tensors(obj: Any, name: str) -> list[Any]:
    import torch

    value = getattr(obj, name, None)
    if isinstance(value, dict):
        value = list(value.values())
    out = []
    for item in value or []:
        out += item if isinstance(item, list) else [item]
    return [t for t in out if isinstance(t, torch.Tensor)]


def _job(name: str) -> Any:
    return {"deepspeed": deepspeed_job, "pp-hand": pipeline_by_hand_job}.get(CONFIGS[name][0], trainer_job)


# ------------------------------------------------------------------------------------------------ the report
def _count_params(args: dict[str, Any]) -> tuple[int, int]:
    import torch

    from lightning_mgpu.demo import GPT, GPTConfig

    with torch.device("meta"):
        gpt = GPT(GPTConfig(block_size=args["block_size"], n_layer=args["n_layer"], n_head=args["n_head"],
                            n_embd=args["n_embd"]))
    total = sum(p.numel() for p in gpt.parameters())
    return total, total - sum(p.numel() for p in gpt.transformer.h.parameters())


def print_report(runs: dict[str, list], args: dict[str, Any]) -> dict[str, Any]:
    dp, n_params, n_root = args["devices"], *_count_params(args)
    results = {name: harness.summarize(done, args["warmup"]) for name, done in runs.items()}
    print(f"\nGPT n_layer={args['n_layer']} n_embd={args['n_embd']} block={args['block_size']}: N={n_params:,}"
          f" ({4 * n_params / MB:.2f} MB fp32); dp={dp} x batch {args['batch_size']}, gloo; {args['repeats']} interleaved"
          f" repeats x {args['steps'] - args['warmup']} timed steps; load {harness.load_average()}")
    pairs = [(name, peer, target) for name, (_, _, peer, target) in CONFIGS.items() if peer and name in results]
    rows = harness.ratio_table(results, pairs)
    head = f"\n{'configuration':<16} {'step ms':>8} {'cpu ms':>7} {'param':>6} {'grad':>6} {'optim':>6} {'MB/step':>8} {'minimum':>8}  collectives/step"
    print(head)
    for name in results:
        first = runs[name][0]
        mem = max((o["memory"] for o in first if o["memory"]), key=lambda m: sum(m.values()), default=None)
        comm = first[0]["comm"]
        minimum, _ = analytic_comm(name, dp, n_params, n_root)
        sent = f"{comm['bytes'] / MB:8.2f}" if comm else f"{'-':>8}"
        least = f"{minimum / MB:8.2f}" if minimum else f"{'-':>8}"
        mems = " ".join(f"{mem[k] / MB:6.2f}" for k in ("params", "grads", "optim")) if mem else f"{'-':>20}"
        print(f"{name:<16} {results[name]['median'] * 1e3:8.1f} {results[name]['cpu'] * 1e3:7.1f} {mems} {sent}"
              f" {least}  {harness.fmt_comm(comm)}")
    print("\nphases, ms (median over steps of the ranks' mean), wall then CPU: forward / backward / optimizer step")
    for name, r in results.items():
        ph = [f"{x * 1e3:.1f}" for x in r["phases"]]
        print(f"  {name:<16} wall {'/'.join(ph[:3]):<18} cpu {'/'.join(ph[3:])}")
    print("\nstep ratio / cpu ratio: median over repeats of (time / peer's time in the same repeat) [min-max].")
    print("param/grad/optim: MB per rank after backward (most loaded rank); MB/step: bytes rank 0 sends per step")
    print("  for the collectives it issued (ring algorithms, profiler count); minimum: " + "; ".join(
        f"{n} {analytic_comm(n, dp, n_params, n_root)[1]}" for n in ("zero0", "zero1", "zero3")))
    return {"results": results, "rows": rows}


def main(argv: Optional[list[str]] = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--devices", type=int, default=2, help="processes (= data-parallel size)")
    parser.add_argument("--steps", type=int, default=20, help="timed steps per run, warm-up included")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=3, help="interleaved runs per configuration")
    parser.add_argument("--n-layer", type=int, default=4)
    parser.add_argument("--n-embd", type=int, default=192)
    parser.add_argument("--n-head", type=int, default=4)
    parser.add_argument("--block-size", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=8, help="per rank")
    parser.add_argument("--mem-step", type=int, default=2)
    parser.add_argument("--only", default="", help=f"comma-separated subset of {','.join(CONFIGS)}")
    parser.add_argument("--timeout", type=float, default=300.0)
    parser.add_argument("--verbose", action="store_true")
    ns = parser.parse_args(argv)
    names = [n.strip() for n in ns.only.split(",") if n.strip()] or list(CONFIGS)
    if set(names) - set(CONFIGS):
        parser.error(f"unknown configurations {sorted(set(names) - set(CONFIGS))}; choose from {list(CONFIGS)}")
    if not 0 <= ns.warmup < ns.steps or not 0 <= ns.mem_step < ns.steps:
        parser.error("need 0 <= --warmup < --steps and 0 <= --mem-step < --steps")
    args = vars(ns)
    import lightning  # noqa: F401  (imported before forking: each job starts in ~1 s)

    import lightning_mgpu  # noqa: F401

    jobs = {name: (_job(name), ns.devices, (name, args)) for name in names}
    runs = harness.run_interleaved(jobs, ns.repeats, ns.timeout, ns.verbose,
                                   report=lambda n, o: f"{harness.summarize([o], ns.warmup)['median'] * 1e3:.1f} ms/step")
    return print_report(runs, args)


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
