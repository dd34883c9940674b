"""Pipeline parallelism under Lightning against the same schedule run by hand, side by side in one interleaved run.

Per layout (``--layouts``, default ``pp2,pp2xdp2``) and schedule (``--schedules``, default ``1F1B``), two
configurations train the demo GPT (``lightning_mgpu.demo``) on the same data, seed, split and microbatches:

=============  ===================================================================================================
name           what
=============  ===================================================================================================
``lightning``  ``Trainer`` + ``HybridStrategy(pipeline_parallel_size=pp, data_parallel_size=dp,
               pipeline_schedule=s, num_microbatches=m)``, the demo ``GPTLightningModule`` unchanged
``hand``       a plain loop written the torchtitan way: each rank keeps only its stage's layers (``HandStage``) at
               the cut points and placement HybridStrategy uses (``plan_split``, ``stage_indices``), with dp > 1
               FSDP2's ``replicate`` on each block and then the stage (what HybridStrategy's ZeRO-0 does under
               pipelining), ``PipelineStage`` + the same torch schedule class with ``loss_fn = cross_entropy / m``
               (``scale_grads=False``), the step's loss where Lightning shows it (the module's
               ``self.log(..., sync_dist=True)``: averaged over dp, then sent from the last stage to the pipeline
               group, whose first rank, global rank 0, holds the progress bar and loggers), then AdamW with the
               demo's parameter groups, on the batches Lightning trains on (``DistributedSampler(shuffle=True)``
               over the dp ranks); process groups looked up once before the loop; AdamW fused (``fused=True``),
               as HybridStrategy steps it on CPU (plain tensors at dp 1, DTensors' local shards at dp > 1)
=============  ===================================================================================================

The launching, timing and ratio table are the shared ones (``benchmarks/run.py``, ``timing.py``, ``report.py``):
each configuration runs in its own forked gloo processes, ``--repeats`` times, interleaved in ABBA order; a step is
timed from ``on_train_batch_start`` to ``on_train_batch_end`` under Lightning and over ``zero_grad`` +
``schedule.step`` + the loss's reporting + ``optimizer.step`` by hand (wall time: the slowest rank; CPU time: the
ranks' mean process CPU time, which does not count waiting for a core and so is the steadier measure on a shared
machine). The last losses of both are printed: they agree. A second table times from one step's start to the next
(``iter``: adds Lightning's loop between steps), a third the CPU time of the least disturbed steps.
``--profile DIR`` runs every rank's timed steps under cProfile (main-thread CPU time) and writes
``DIR/<configuration>-rank<r>.prof`` for ``pstats``: calls and times of ours and by hand side by side.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from benchmarks import demo_gpt
from benchmarks.probes import make_step_probe
from benchmarks.report import interval_table, ratio_table, thread_table
from benchmarks.run import fit, load_average, run_interleaved, start_rank
from benchmarks.stats import summarize
from benchmarks.timing import PROFILED_NOTE, LoopTimer, StepProfile
from lightning_mgpu.parallel.pipeline import PIPELINE_SCHEDULES as SCHEDULES

if TYPE_CHECKING:
    from lightning_mgpu.demo import GPT

TARGET = 1.05


def parse_layout(text: str) -> tuple[int, int]:
    """``"pp2"`` -> (2, 1), ``"pp2xdp2"`` -> (2, 2)."""
    match = re.fullmatch(r"pp(\d+)(?:xdp(\d+))?", text.strip().lower())
    if match is None or int(match[1]) < 2 or int(match[2] or 1) < 1:
        raise ValueError(f"layout {text!r}: write it as pp<N>[xdp<M>] with N >= 2, e.g. pp2 or pp2xdp2")
    return int(match[1]), int(match[2] or 1)


# ------------------------------------------------------------------------------------------------ in the ranks
def lightning_job(schedule: str, pp: int, dp: int, args: dict[str, Any]) -> dict[str, Any]:
    """One ``Trainer.fit`` under ``HybridStrategy`` in this rank, timed by the shared step probe."""
    from lightning_mgpu import HybridStrategy
    from lightning_mgpu.demo import GPTLightningModule

    start_rank(args["verbose"])
    probe = make_step_probe(mem_step=args["steps"], verbose=args["verbose"])
    profile = _step_profile(f"{schedule} pp{pp}xdp{dp} lightning", args)
    strategy = HybridStrategy(
        pipeline_parallel_size=pp,
        data_parallel_size=dp,
        pipeline_schedule=schedule,
        num_microbatches=args["microbatches"] or 2 * pp,
    )
    module, data = GPTLightningModule(**demo_gpt.gpt_kwargs(args)), demo_gpt.demo_data(args, args["batch_size"] // dp)
    callbacks = [probe, profile.callback()]
    return fit(probe, module, data, callbacks, devices=pp * dp, strategy=strategy, max_steps=args["steps"])


def _step_profile(name: str, args: dict[str, Any]) -> StepProfile:
    """With ``--profile DIR``: every rank's timed steps (warm-up left out) under cProfile, written to
    ``DIR/<configuration>-rank<r>.prof`` (of the last repeat), to compare the calls with ``pstats``."""
    path = Path(args["profile"]) / f"{name.replace(' ', '-')}.prof" if args.get("profile") else None
    return StepProfile(path, range(args["warmup"], args["steps"]), ranks=None)


def hand_job(schedule: str, pp: int, dp: int, args: dict[str, Any]) -> dict[str, Any]:
    """The same schedule by hand in this rank (see the module docstring), timed by the shared ``LoopTimer``."""
    start_rank(args["verbose"])
    import torch.distributed as dist

    dist.init_process_group("gloo")
    return run_by_hand(schedule, args["microbatches"] or 2 * pp, pp, dp, args)


class HandStage(nn.Module):
    """One stage of the demo GPT built the torchtitan way: this stage's layers kept, the others dropped (None)."""

    def __init__(self, gpt: GPT, blocks: range, first: bool, last: bool) -> None:
        super().__init__()
        t = gpt.transformer
        self.wte: nn.Module | None = t.wte if first else None
        self.wpe: nn.Module | None = t.wpe if first else None
        self.h = nn.ModuleDict({str(i): t.h[i] for i in blocks})
        self.ln_f: nn.Module | None = t.ln_f if last else None
        self.lm_head: nn.Module | None = gpt.lm_head if last else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.wte is not None and self.wpe is not None:  # the first stage holds both
            x = self.wte(x) + self.wpe(torch.arange(x.size(1), device=x.device))
        for block in self.h.values():
            x = block(x)
        if self.lm_head is not None and self.ln_f is not None:  # the last stage holds both
            x = self.lm_head(self.ln_f(x))
        return x


def run_by_hand(
    schedule: str,
    m: int,
    pp: int,
    dp: int,
    args: dict[str, Any],
    replica_batch: int | None = None,
    profile: StepProfile | None = None,
) -> dict[str, Any]:
    """Train ``args["steps"]`` steps with torch's ``schedule`` over hand-built stages; the ``LoopTimer`` result.

    ``replica_batch``: the batch of each pipeline (data-parallel rank), default ``--batch-size`` split over dp;
    ``profile``: the timed steps' cProfile (default: ``--profile``'s, every rank)."""
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining.schedules import get_schedule_class

    from lightning_mgpu.demo import GPTLightningModule
    from lightning_mgpu.parallel.pipeline import plan_split, stage_indices, stage_owner, stages_per_rank

    mesh = init_device_mesh("cpu", (pp, dp), mesh_dim_names=("pp", "dp"))  # HybridStrategy's order: pp outermost
    pp_rank, dp_rank = mesh["pp"].get_local_rank(), mesh["dp"].get_local_rank()
    demo = GPTLightningModule(**demo_gpt.gpt_kwargs(args))  # the same seeded init as Lightning's run
    gpt = demo.model
    per_rank = stages_per_rank(schedule, None)
    num_stages = pp * per_rank
    split = plan_split(gpt, num_stages, "auto")
    mine = stage_indices(schedule, pp_rank, pp, per_rank)
    modules = [HandStage(gpt, split.blocks_of(s), s == 0, s == num_stages - 1) for s in mine]
    if dp > 1:
        from torch.distributed._composable.replicate_with_fsdp import replicate

        for module in modules:
            for block in module.h.values():
                replicate(block, mesh=mesh["dp"])
            replicate(module, mesh=mesh["dp"])
    stages = [
        PipelineStage(module, s, num_stages, torch.device("cpu"), group=mesh["pp"].get_group())
        for s, module in zip(mine, modules)
    ]

    def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1)) / m

    pipe = get_schedule_class(schedule)(
        stages[0] if len(stages) == 1 else stages, m, loss_fn=loss_fn, scale_grads=False
    )
    # The demo's model swapped for this rank's stages: its configure_optimizers (its groups) over them.
    demo.add_module("model", nn.ModuleList(modules))
    optimizer = demo.configure_optimizers()
    # As HybridStrategy steps AdamW on CPU where the module left `foreach`/`fused` unset (``local_step.fused_on_cpu``:
    # plain tensors at dp 1, the local shards of DTensors through ``ShardLocalStep`` at dp > 1): one fused kernel per
    # group, not AdamW's per-tensor loop (~5x the CPU time), so that the ratio measures the pipeline runtime and
    # Lightning rather than the optimizer path.
    for group in optimizer.param_groups:
        group["fused"] = True
    replica_batch = replica_batch or args["batch_size"] // dp
    dm = demo_gpt.demo_data(args, replica_batch)
    dm.setup()
    loader = demo_gpt.lightning_order(dm.train_dataset, replica_batch, replicas=dp, rank=dp_rank)
    # Looked up once, as a hand-written loop does (slicing the mesh costs ~0.1 ms per step).
    dp_group, pp_group = mesh["dp"].get_group(), mesh["pp"].get_group()
    last_stage_rank = dist.get_global_rank(pp_group, stage_owner(schedule, num_stages - 1, pp, per_rank))
    timer, loss = LoopTimer(), float("nan")
    profile = profile or _step_profile(f"{schedule} pp{pp}xdp{dp} hand", args)
    for step, (x, y) in enumerate(loader):
        if step == args["steps"]:
            break
        losses: list[torch.Tensor] = []
        with timer.step():
            profile.start(step)
            optimizer.zero_grad(set_to_none=True)
            inputs = (x,) if 0 in mine else ()
            targets = {"target": y, "losses": losses} if num_stages - 1 in mine else {}
            pipe.step(*inputs, **targets)
            # The loss where Lightning shows it: the module's `self.log("train_loss", loss, sync_dist=True)` is
            # a mean over dp, logged by global rank 0, which holds the first stage (progress bar, loggers).
            reported = torch.stack([loss.detach() for loss in losses]).sum() if losses else torch.zeros(())
            if losses and dp > 1:
                dist.all_reduce(reported, group=dp_group)
            dist.broadcast(reported, src=last_stage_rank, group=pp_group)
            optimizer.step()
        profile.stop()
        loss = float(reported) / dp
    profile.dump()
    dist.barrier()
    return {**timer.result(), "memory": None, "comm": None, "loss": loss, "rank": dist.get_rank()}


# ------------------------------------------------------------------------------------------------ the report
def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layouts", default="pp2,pp2xdp2", help="comma-separated pp<N>[xdp<M>] (processes: N*M)")
    parser.add_argument("--schedules", default="1F1B", help=f"comma-separated subset of {','.join(SCHEDULES)}")
    parser.add_argument("--microbatches", type=int, default=0, help="per step (default 2*pp)")
    parser.add_argument("--profile", default="", help="directory: cProfile of every rank's timed steps per run")
    # 15 repeats: each repeat's ratio swings by ~6-10% (the same job reruns up to 7% slower or faster on this
    # 2-core VM), so the median of 5 moves by ~+-4%, more than the pair's distance to its target.
    demo_gpt.add_run_args(parser, steps=40, warmup=5, repeats=15, batch_help="per pipeline (split over its dp ranks)")
    args = demo_gpt.parse_run_args(parser, argv)
    ns = argparse.Namespace(**args)
    try:
        layouts = {text: parse_layout(text) for text in ns.layouts.split(",") if text.strip()}
    except ValueError as err:
        parser.error(str(err))
    schedules = [s.strip() for s in ns.schedules.split(",") if s.strip()]
    if set(schedules) - set(SCHEDULES):
        parser.error(f"unknown schedules {sorted(set(schedules) - set(SCHEDULES))}; choose from {list(SCHEDULES)}")
    demo_gpt.preload("torch.distributed.pipelining")

    jobs, pairs = {}, []
    for text, (pp, dp) in layouts.items():
        if ns.batch_size % dp or (ns.batch_size // dp) % (ns.microbatches or 2 * pp):
            parser.error(f"--batch-size {ns.batch_size} does not split over dp {dp} into equal microbatches")
        for schedule in schedules:
            name = f"{schedule} {text}"
            jobs[f"{name} hand"] = (hand_job, pp * dp, (schedule, pp, dp, args))
            jobs[f"{name} lightning"] = (lightning_job, pp * dp, (schedule, pp, dp, args))
            pairs.append((f"{name} lightning", f"{name} hand", TARGET))
    load_before = load_average()
    runs = run_interleaved(jobs, ns.repeats, ns.timeout, ns.verbose, abba=True)
    results = {name: summarize(done, ns.warmup) for name, done in runs.items()}
    print(
        f"\nGPT n_layer={ns.n_layer} n_embd={ns.n_embd} block={ns.block_size}, batch {ns.batch_size} per pipeline,"
        f" m={ns.microbatches or '2*pp'} microbatches; gloo, 1 thread per rank, {os.cpu_count()} cores;"
        f" {ns.repeats} interleaved repeats x {ns.steps - ns.warmup} timed steps; load {load_before} before,"
        f" {load_average()} after"
    )
    if ns.profile:
        print(PROFILED_NOTE)
    rows = ratio_table(results, pairs)
    # From one step's start to the next: adds what either side does between steps (fetching the batch by hand;
    # Lightning's loop: its data fetcher, batch transfer hooks, logger connector, scheduler and validation checks).
    ratio_table(results, pairs, title="\nfrom one step's start to the next:", span="iter")
    thread_table(results, pairs)
    interval_table(results, pairs)
    _quiet_steps_table(runs, pairs, ns.warmup)
    print("\nlast step's loss (mean over dp), Lightning vs by hand:")
    for name, peer, _ in pairs:
        if name in runs and peer in runs:
            print(f"  {name:<28} {_last_loss(runs[name]):.5f}  {_last_loss(runs[peer]):.5f}")
    return {"results": results, "rows": rows}


QUIET = 0.2  # the quantile of steps' CPU times read as "least disturbed"


def _quiet_steps_table(runs: dict[str, list], pairs: list[tuple[str, str, float]], warmup: int) -> None:
    """CPU-time ratios of the least disturbed steps: per repeat, the ``QUIET`` quantile over the timed steps of the
    ranks' mean CPU time. Another process sharing a core makes a step's own CPU time longer too (caches), by an
    amount that varies from run to run; the quiet steps are the closer to the work itself. Supplementary: the
    target is judged on the medians above."""
    per_step = lambda outputs: [statistics.mean(s) for s in zip(*(o["cpu_times"] for o in outputs))][warmup:]
    quiet = {name: [_quantile(per_step(outputs)) for outputs in done] for name, done in runs.items()}
    print(f"\nCPU time of the least disturbed steps ({QUIET:.0%} quantile per repeat), ours / by hand:")
    for name, peer, _ in pairs:
        if name in quiet and peer in quiet:
            ratios = sorted(a / b for a, b in zip(quiet[name], quiet[peer]))
            ours, theirs = (statistics.median(quiet[n]) * 1e3 for n in (name, peer))
            print(
                f"  {name:<28} {ours:6.1f} ms vs {theirs:6.1f} ms:"
                f" {statistics.median(ratios):.3f} [{ratios[0]:.2f}-{ratios[-1]:.2f}]"
            )


def _quantile(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(QUIET * len(ordered)))]


def _last_loss(repeats: list[list[dict[str, Any]]]) -> float:
    """The last step's loss in the first repeat, averaged over the ranks that hold it (the last stage's dp ranks by
    hand; every rank under Lightning, which logs it with ``sync_dist=True``)."""
    losses = [o["loss"] for o in repeats[0] if o.get("loss") == o.get("loss")]
    return sum(losses) / len(losses) if losses else float("nan")


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
