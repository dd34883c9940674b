"""ScalingMonitor's overhead on step time, measured two ways in one run.

1. *What the monitor adds, counted*: in monitored fits of the demo GPT at ``dp2``, ``tp2`` and ``pp2`` (2 forked
   gloo processes, ``every_n_steps=1``: every step measured, the worst case), the time spent inside the monitor's
   own hooks per step (thread CPU time around them) plus the number of collectives, waits and fetches it timed per step
   (``timed_calls`` of its report) times the cost of one timer wrapper (a microbenchmark in one process: a gloo
   ``all_reduce`` and a functional-collective ``all_reduce`` + wait, patched and active vs plain, median of
   alternating rounds). Divided by the step's process CPU time (median, rank 0). Stable on a loaded machine: it
   counts work, not the waits of a preempted process.
2. *Side by side*: the same fits with and without the monitor, interleaved (``report.ratio_table``:
   median of per-repeat ratios of the slowest rank's median time from one step's start to the next, every hook
   included, and of process CPU time). On a shared 2-core
   machine its spread is far wider than 3%; it is printed to show the order of magnitude, not to judge the target.

    .venv/bin/python -m benchmarks.bench_monitor [--repeats 2] [--steps 20]
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from typing import Any

from benchmarks import demo_gpt
from benchmarks.probes import make_step_probe
from benchmarks.report import ratio_table
from benchmarks.run import fit, load_average, run_interleaved, run_or_report, start_rank
from benchmarks.stats import summarize

LAYOUTS = {"dp2": (2, 1, 1), "tp2": (1, 2, 1), "pp2": (1, 1, 2)}
TARGET = 1.03
_HOOKS = ("on_train_batch_start", "on_before_optimizer_step", "on_train_batch_end")


def _self_timed_monitor(**kwargs: Any) -> Any:
    """A ScalingMonitor whose per-step hooks add up the CPU time spent inside them."""
    from lightning_mgpu import ScalingMonitor

    class SelfTimed(ScalingMonitor):
        hook_seconds = 0.0

    def timing(hook: Any) -> Any:
        def timed(self: Any, *args: Any) -> None:
            start = time.thread_time()  # CPU work: a preempted hook on a loaded machine would count its wait
            try:
                hook(self, *args)
            finally:
                type(self).hook_seconds += time.thread_time() - start

        return timed

    for name in _HOOKS:
        setattr(SelfTimed, name, timing(getattr(ScalingMonitor, name)))
    return SelfTimed(**kwargs)


def wrapper_cost(calls: int = 1000, rounds: int = 9) -> dict[str, float]:
    """CPU seconds one timer wrapper adds to a gloo collective and to a functional collective + wait (world of 1)."""
    import torch
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol

    from lightning_mgpu.monitor.timing import Clock, CollectiveTimer, StepRecorder

    if not dist.is_initialized():
        dist.init_process_group("gloo")
    world = dist.group.WORLD
    assert world is not None  # initialized above

    def dist_call() -> None:
        dist.all_reduce(tensor)

    def funcol_call() -> None:
        funcol.all_reduce(tensor, "sum", world).wait()

    def cpu_per_call(fn: Any) -> float:  # CPU time of this thread: the wrapper's work, not a preempted wait
        start = time.thread_time()
        for _ in range(calls):
            fn()
        return (time.thread_time() - start) / calls

    tensor = torch.ones(16)
    recorder = StepRecorder(Clock(torch.device("cpu")))
    timer = CollectiveTimer(recorder, {}, world_axis="dp")
    result = {}
    for name, fn in (("all_reduce", dist_call), ("funcol_all_reduce_wait", funcol_call)):
        differences = []
        for _ in range(rounds):  # plain and patched alternate, so that a drift of the machine hits both
            plain = cpu_per_call(fn)
            timer.install()
            recorder.begin(recorder.clock.mark())
            try:
                patched = cpu_per_call(fn)
            finally:
                recorder.active = False
                timer.remove()
            differences.append(patched - plain)
        result[name] = max(0.0, statistics.median(differences))
    return result


def job(layout: str, monitored: bool, args: dict[str, Any]) -> dict[str, Any]:
    from lightning_mgpu import HybridStrategy
    from lightning_mgpu.demo import GPTLightningModule

    dp, tp, pp = LAYOUTS[layout]
    start_rank(args["verbose"])
    probe = make_step_probe(verbose=args["verbose"])  # its 'iter' times: start to next start, all hooks in
    out = Path(args["out"]) / layout
    monitor = _self_timed_monitor(every_n_steps=1, dirpath=out, verbose=False) if monitored else None
    strategy = HybridStrategy(data_parallel_size=dp, tensor_parallel_size=tp, pipeline_parallel_size=pp)
    module, callbacks = GPTLightningModule(**demo_gpt.gpt_kwargs(args)), [monitor, probe] if monitor else [probe]
    result = fit(
        probe,
        module,
        demo_gpt.demo_data(args),
        callbacks,
        devices=dp * tp * pp,
        strategy=strategy,
        max_steps=args["steps"],
    )
    if monitor is not None:
        report = monitor.report
        result["hook_s_per_step"] = type(monitor).hook_seconds / args["steps"]
        if report is not None:  # global rank 0
            result["timed_calls"] = sum(s["timed_calls"] for s in report["steps"]) / len(report["steps"])
            result["step_s"] = report["time_split"]["step_s"]
    return result


def _counted_overhead(runs: dict[str, list], cost: float, warmup: int) -> None:
    print(f"What the monitor adds per step, counted (one timer wrapper costs {cost * 1e6:.1f} us; target < 3%):")
    print(f"{'configuration':<16}{'CPU ms':>9}{'hooks us':>10}{'timed calls':>13}{'wrappers us':>13}{'overhead':>10}")
    for name, outputs in runs.items():
        if not name.endswith("+mon"):
            continue
        for repeat in outputs:
            rank0 = repeat[0]
            hooks = max(o["hook_s_per_step"] for o in repeat)
            wrappers = rank0["timed_calls"] * cost
            step_cpu = statistics.median(rank0["iter_cpu_times"][warmup:] or rank0["iter_cpu_times"])
            share = (hooks + wrappers) / step_cpu
            verdict = "ok" if share < TARGET - 1 else "MISSED"
            print(
                f"{name:<16}{step_cpu * 1e3:>9.1f}{hooks * 1e6:>10.0f}{rank0['timed_calls']:>13.0f}"
                f"{wrappers * 1e6:>13.0f}{share:>10.2%} {verdict}"
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    demo_gpt.add_run_args(parser, repeats=2, block_size=128, n_embd=128)
    parser.add_argument("--out", default="/tmp/bench_monitor", help="where the monitored runs write their reports")
    args = demo_gpt.parse_run_args(parser, None)
    options = argparse.Namespace(**args)
    print(
        f"bench_monitor: demo GPT n_embd={options.n_embd} block={options.block_size} batch={options.batch_size},"
        f" {options.steps} steps x {options.repeats} repeats; load average {load_average()}"
    )
    jobs = {}
    for layout, (dp, tp, pp) in LAYOUTS.items():
        jobs[layout] = (job, dp * tp * pp, (layout, False, args))
        jobs[f"{layout}+mon"] = (job, dp * tp * pp, (layout, True, args))
    costs = run_or_report("wrapper cost", wrapper_cost, 1)
    cost = max(costs[0].values()) if costs else float("nan")
    print("timer wrapper cost per call (us):", {k: round(v * 1e6, 2) for k, v in (costs[0] if costs else {}).items()})
    runs = run_interleaved(jobs, options.repeats, options.timeout, options.verbose)
    _counted_overhead(runs, cost, options.warmup)
    results = {name: summarize(outputs, options.warmup) for name, outputs in runs.items()}
    ratio_table(
        results,
        [(f"{layout}+mon", layout, TARGET) for layout in LAYOUTS],
        span="iter",
        title="ScalingMonitor overhead (monitored / plain, step start to next start; target <= 1.03)",
    )


if __name__ == "__main__":
    main()
