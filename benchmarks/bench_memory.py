"""Benchmark activation checkpointing: activation memory and peak memory per rank, and the step-time it costs.

One run fits the demo GPT (``lightning_mgpu.demo``) with Lightning's ``Trainer`` and ``HybridStrategy`` three times,
each in its own set of forked gloo processes (``tests/helpers/distributed.run_distributed``), with the same model,
data, seed, layout (``--devices`` data-parallel ranks at ``--zero-stage``) and per-rank batch:

================  ==========================================================================================
name              ``activation_checkpointing=``
================  ==========================================================================================
``off``           ``False``
``full``          ``"full"``: each block keeps only its input; its inside is recomputed in backward
``selective``     ``"selective"``: matmul and attention outputs are kept, cheap ops are recomputed
================  ==========================================================================================

Measured per rank (the notes printed under the table say the same):

- step time: wall time ``on_train_batch_start`` -> ``on_train_batch_end``, per step the slowest rank, median over
  the steps after ``--warmup``; and the process CPU time of the same span (less sensitive to other jobs);
- on one extra, untimed step (tensor tracking slows it down): the bytes of tensors created in forward that are still
  alive when backward starts (the activations autograd keeps, parameters left out), and the peak bytes of tensors
  created during forward + backward (activations, temporaries, gradients; ``ActivationMemory`` in
  ``lightning_mgpu.parallel.activation``); and the process's peak resident memory over that step (Linux ``VmHWM``
  after resetting it through ``/proc/self/clear_refs``).

Run ``python benchmarks/bench_memory.py --help`` for the flags.
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import sys
import time
import warnings
from pathlib import Path
from typing import Any, Optional

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

import torch  # noqa: E402, F401  (imported before forking)

from benchmarks.harness import QUIET_TRAINER, run_or_report  # noqa: E402

SEED = 1234
MB = 2**20
CONFIGS: dict[str, Any] = {"off": False, "full": "full", "selective": "selective"}


def _status_kib(field: str) -> Optional[int]:
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def _reset_peak_rss() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as clear_refs:
            clear_refs.write("5")  # resets VmHWM to the current RSS (Linux >= 4.0)
        return True
    except OSError:
        return False


def _make_probe(measure_step: int) -> Any:
    import lightning as L

    from lightning_mgpu.parallel.activation import ActivationMemory

    class Probe(L.Callback):
        def __init__(self) -> None:
            self.times: list[float] = []
            self.cpu_times: list[float] = []
            self.memory: dict[str, Any] = {}
            self._tracker: Optional[ActivationMemory] = None

        def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
            if trainer.global_step == measure_step:
                self.memory["rss_start"] = _status_kib("VmRSS")
                self.memory["rss_reset"] = _reset_peak_rss()
                self._tracker = ActivationMemory().__enter__()
            self._t0, self._c0 = time.perf_counter(), time.process_time()

        def on_before_backward(self, trainer: Any, pl_module: Any, loss: Any) -> None:
            if self._tracker is not None:
                self.memory["held_after_forward"] = self._tracker.held_bytes(exclude=list(pl_module.parameters()))

        def on_after_backward(self, trainer: Any, pl_module: Any) -> None:
            if self._tracker is not None:
                self._tracker.__exit__(None, None, None)
                self.memory["peak_tensors"] = self._tracker.peak_bytes
                self._tracker = None
                if self.memory["rss_reset"]:
                    self.memory["rss_peak"] = _status_kib("VmHWM")

        def on_train_batch_end(self, trainer: Any, pl_module: Any, *args: Any) -> None:
            if trainer.global_step - 1 != measure_step:  # global_step already counts this step
                self.times.append(time.perf_counter() - self._t0)
                self.cpu_times.append(time.process_time() - self._c0)

    return Probe()


def fit_job(name: str, args: dict[str, Any]) -> dict[str, Any]:
    if not args["verbose"]:
        warnings.filterwarnings("ignore")
        for logger_name in ("lightning", "lightning.pytorch", "lightning.fabric", "torch.distributed", "torchao"):
            logging.getLogger(logger_name).setLevel(logging.ERROR)
    from datetime import timedelta

    import lightning as L

    from lightning_mgpu import HybridStrategy
    from lightning_mgpu.demo import GPTLightningModule, TextDataModule

    L.seed_everything(SEED, verbose=False)
    module = GPTLightningModule(block_size=args["block_size"], n_layer=args["n_layer"], n_head=args["n_head"],
                                n_embd=args["n_embd"], seed=SEED)
    datamodule = TextDataModule(batch_size=args["batch_size"], block_size=args["block_size"], val_fraction=0.1)
    steps = args["steps"]
    probe = _make_probe(measure_step=steps)
    strategy = HybridStrategy(zero_stage=args["zero_stage"], activation_checkpointing=CONFIGS[name],
                              timeout=timedelta(seconds=120))
    trainer = L.Trainer(
        accelerator="cpu", devices=args["devices"], strategy=strategy, precision=args["precision"],
        max_steps=steps + 1,  # the last step is measured for memory and not timed
        callbacks=[probe], **QUIET_TRAINER,
    )
    trainer.fit(module, datamodule)
    return {"rank": trainer.global_rank, "times": probe.times, "cpu_times": probe.cpu_times, "memory": probe.memory,
            "loss": float(trainer.callback_metrics.get("train_loss", float("nan")))}


def summarize(outputs: list[dict[str, Any]], warmup: int) -> dict[str, Any]:
    slowest = [max(step) for step in zip(*(o["times"] for o in outputs))][warmup:]
    cpu = [max(step) for step in zip(*(o["cpu_times"] for o in outputs))][warmup:]
    memory = [o["memory"] for o in sorted(outputs, key=lambda o: o["rank"])]

    def per_rank_max(key: str) -> Optional[float]:
        values = [m.get(key) for m in memory]
        return None if any(v is None for v in values) else max(values)

    rss = [m["rss_peak"] for m in memory if m.get("rss_peak") is not None]
    return {
        "median": statistics.median(slowest), "cpu": statistics.median(cpu),
        "held": per_rank_max("held_after_forward"), "peak": per_rank_max("peak_tensors"),
        "rss": max(rss) * 1024 if len(rss) == len(memory) else None,
        "loss": outputs[0]["loss"],
    }


def _ratio(value: Optional[float], base: Optional[float]) -> str:
    return "-" if value is None or not base else f"x{value / base:.2f}"


def _mib(value: Optional[float]) -> str:
    return "n/a" if value is None else f"{value / MB:.2f}"


def print_report(results: dict[str, dict[str, Any]], args: dict[str, Any]) -> None:
    base = results.get("off", {})
    print()
    print(f"demo GPT n_layer={args['n_layer']} n_embd={args['n_embd']} n_head={args['n_head']} block={args['block_size']},"
          f" batch {args['batch_size']}/rank, {args['devices']} ranks, zero_stage={args['zero_stage']},"
          f" precision={args['precision']}")
    header = (f"{'config':<10} {'step ms':>8} {'vs off':>7} {'cpu ms':>7} {'vs off':>7} {'act MiB':>8} {'vs off':>7}"
              f" {'peak MiB':>9} {'vs off':>7} {'RSS MiB':>9} {'loss':>8}")
    print(header)
    print("-" * len(header))
    for name, r in results.items():
        print(f"{name:<10} {r['median'] * 1e3:>8.1f} {_ratio(r['median'], base.get('median')):>7}"
              f" {r['cpu'] * 1e3:>7.1f} {_ratio(r['cpu'], base.get('cpu')):>7}"
              f" {_mib(r['held']):>8} {_ratio(r['held'], base.get('held')):>7}"
              f" {_mib(r['peak']):>9} {_ratio(r['peak'], base.get('peak')):>7} {_mib(r['rss']):>9} {r['loss']:>8.4f}")
    print()
    print("step ms: median wall time per optimizer step (slowest rank), after the warm-up steps; cpu ms: the same for")
    print("  process CPU time. 'vs off' columns: ratio to activation_checkpointing=False (step time: the cost;")
    print("  memory: the saving, smaller is better).")
    print("act MiB: per rank (the largest), bytes of tensors made in forward still alive when backward starts (the")
    print("  activations kept for backward; parameters excluded). peak MiB: largest total of tensors made during")
    print("  forward + backward alive at once (activations, temporaries, gradients; parameters and optimizer states")
    print("  made before the step are not counted). RSS MiB: peak resident memory of the process during that step (the")
    print("  largest rank; it includes torch itself, ~300 MiB, and the allocator keeps freed memory, so small models")
    print("  barely move it).")
    print("Losses are equal across configurations: checkpointing recomputes the same ops.")


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--devices", type=int, default=2, help="processes (= data-parallel size) per run")
    parser.add_argument("--zero-stage", type=int, default=2, choices=(0, 1, 2, 3))
    parser.add_argument("--precision", type=str, default="32-true", help="e.g. 32-true, bf16-mixed, 16-mixed")
    parser.add_argument("--steps", type=int, default=12, help="timed optimizer steps per run, warm-up included")
    parser.add_argument("--warmup", type=int, default=2, help="first steps left out of the median")
    parser.add_argument("--n-layer", type=int, default=4)
    parser.add_argument("--n-embd", type=int, default=192)
    parser.add_argument("--n-head", type=int, default=4)
    parser.add_argument("--block-size", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=8, help="per rank")
    parser.add_argument("--only", type=str, default="", help=f"comma-separated subset of {','.join(CONFIGS)}")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per configuration")
    parser.add_argument("--verbose", action="store_true", help="keep Lightning's and torch's messages")
    ns = parser.parse_args(argv)
    args = vars(ns)
    if not 0 <= ns.warmup < ns.steps:
        parser.error("need 0 <= --warmup < --steps")
    names = [n.strip() for n in ns.only.split(",") if n.strip()] or list(CONFIGS)
    unknown = set(names) - set(CONFIGS)
    if unknown:
        parser.error(f"unknown configurations {sorted(unknown)}; choose from {list(CONFIGS)}")

    # Import everything the ranks need before forking, so each job starts in ~1 s.
    import lightning  # noqa: F401

    import lightning_mgpu  # noqa: F401
    import lightning_mgpu.demo  # noqa: F401

    results: dict[str, dict[str, Any]] = {}
    start = time.perf_counter()
    for name in names:
        t0 = time.perf_counter()
        outputs = run_or_report(name, fit_job, ns.devices, name, args, timeout=ns.timeout, verbose=ns.verbose)
        if outputs is None:
            continue
        results[name] = summarize(outputs, ns.warmup)
        print(f"{name}: {results[name]['median'] * 1e3:.1f} ms/step median ({time.perf_counter() - t0:.1f} s job)",
              flush=True)
    print(f"total {time.perf_counter() - start:.0f} s")
    print_report(results, args)


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
