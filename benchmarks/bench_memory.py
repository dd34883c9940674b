"""Benchmark activation checkpointing: activation memory and peak memory per rank, and the step-time it costs.

One run fits the demo GPT (``lightning_mgpu.demo``) with Lightning's ``Trainer`` and ``HybridStrategy`` three times,
each in its own set of forked gloo processes, with the same model,
data, seed, layout (``--devices`` data-parallel ranks at ``--zero-stage``) and per-rank batch:

================  ==========================================================================================
name              ``activation_checkpointing=``
================  ==========================================================================================
``off``           ``False``
``full``          ``"full"``: each block keeps only its input; its inside is recomputed in backward
``selective``     ``"selective"``: matmul and attention outputs are kept, cheap ops are recomputed
================  ==========================================================================================

Measured per rank (the notes printed under the table say the same):

- step time (``benchmarks/probes.py``'s step probe): wall time ``on_train_batch_start`` -> ``on_train_batch_end``, per
  step the slowest rank, median over the steps after ``--warmup`` and the ``--repeats`` interleaved runs; and the
  process CPU time of the same span (mean of the ranks; less sensitive to other jobs);
- on one extra, untimed step (tensor tracking slows it down): the bytes of tensors created in forward that are still
  alive when backward starts (the activations autograd keeps, parameters left out), and the peak bytes of tensors
  created during forward + backward (activations, temporaries, gradients; ``ActivationMemory`` in
  ``lightning_mgpu.parallel.activation``); and the process's peak resident memory over that step (Linux ``VmHWM``
  after resetting it through ``/proc/self/clear_refs``).

Run ``python -m benchmarks.bench_memory --help`` (from the repository root) for the flags.
"""

from __future__ import annotations

import argparse
import os
from typing import TYPE_CHECKING, Any

from benchmarks import demo_gpt
from benchmarks.probes import make_step_probe
from benchmarks.report import MB, table
from benchmarks.run import fit, load_average, run_interleaved, start_rank
from benchmarks.stats import summarize

if TYPE_CHECKING:
    from lightning_mgpu.parallel.activation import ActivationMemory

CONFIGS: dict[str, Any] = {"off": False, "full": "full", "selective": "selective"}


def _status_kib(field: str) -> int | None:
    try:
        with open("/proc/self/status") as status:
            return next((int(line.split()[1]) for line in status if line.startswith(field + ":")), None)
    except OSError:
        return None


class ActivationProbe:
    """Around one untimed step: bytes of forward's tensors alive when backward starts (parameters left out), the
    peak bytes of tensors made during forward + backward, and the process's peak RSS over them (``VmHWM``)."""

    def __init__(self, module: Any) -> None:
        self.module = module
        self.result: dict[str, Any] = {}
        self._tracker: ActivationMemory | None = None

    def __enter__(self) -> ActivationProbe:
        from lightning_mgpu.parallel.activation import ActivationMemory

        try:
            with open("/proc/self/clear_refs", "w") as clear_refs:
                clear_refs.write("5")  # resets VmHWM to the current RSS (Linux >= 4.0)
            self._rss = True
        except OSError:
            self._rss = False
        self._tracker = ActivationMemory().__enter__()
        return self

    @property
    def phase(self) -> str:
        return "forward" if "held" not in self.result else "backward" if self._tracker else "optimizer"

    @phase.setter
    def phase(self, name: str) -> None:
        if name == "backward":
            assert self._tracker is not None  # told the phase inside the step only
            self.result["held"] = self._tracker.held_bytes(exclude=list(self.module.parameters()))
        else:
            self.__exit__()

    def __exit__(self, *exc: Any) -> None:
        if self._tracker is not None:
            self._tracker.__exit__(None, None, None)
            self.result["peak"], self._tracker = self._tracker.peak_bytes, None
            rss = _status_kib("VmHWM") if self._rss else None
            self.result["rss"] = rss * 1024 if rss is not None else None


def fit_job(name: str, args: dict[str, Any]) -> dict[str, Any]:
    from datetime import timedelta

    from lightning_mgpu import HybridStrategy
    from lightning_mgpu.demo import GPTLightningModule

    start_rank(args["verbose"])
    module = GPTLightningModule(**demo_gpt.gpt_kwargs(args))
    steps = args["steps"]  # then one more, measured for memory and not timed
    probe = make_step_probe(probes={steps: lambda trainer: ActivationProbe(module)}, verbose=args["verbose"])
    strategy = HybridStrategy(
        zero_stage=args["zero_stage"], activation_checkpointing=CONFIGS[name], timeout=timedelta(seconds=120)
    )
    result = fit(
        probe,
        module,
        demo_gpt.demo_data(args),
        devices=args["devices"],
        strategy=strategy,
        precision=args["precision"],
        max_steps=steps + 1,
    )
    return {**result, "activations": result["probes"][steps]}


def _memory(runs: list[list[dict[str, Any]]], key: str) -> float | None:
    """The largest rank's value in the first repeat (None where a rank could not measure it)."""
    values = [o["activations"].get(key) for o in runs[0]]
    return None if any(v is None for v in values) else max(values)


def print_report(runs: dict[str, list], args: dict[str, Any]) -> None:
    results = {name: summarize(done, args["warmup"]) for name, done in runs.items()}
    for name, r in results.items():
        r.update({key: _memory(runs[name], key) for key in ("held", "peak", "rss")})
    base = results.get("off", {})
    ratio = lambda key: lambda n, r: f"x{r[key] / base[key]:.2f}" if base.get(key) and r[key] else "-"
    mib = lambda key: lambda n, r: "n/a" if r[key] is None else f"{r[key] / MB:.2f}"
    print(
        f"\ndemo GPT n_layer={args['n_layer']} n_embd={args['n_embd']} n_head={args['n_head']} block="
        f"{args['block_size']}, batch {args['batch_size']}/rank, {args['devices']} ranks, zero_stage="
        f"{args['zero_stage']}, precision={args['precision']}; load {load_average()}"
    )
    columns = {
        "step/off": ratio("median"),
        "cpu/off": ratio("cpu"),
        "act MiB": mib("held"),
        "act/off": ratio("held"),
        "peak MiB": mib("peak"),
        "peak/off": ratio("peak"),
        "RSS MiB": mib("rss"),
        "    loss": lambda n, r: f"{r['loss']:.4f}",
    }
    table(results, columns)
    print(NOTES)


NOTES = """
step ms: median wall time per optimizer step (slowest rank), after the warm-up steps; cpu ms: the same for process
  CPU time. '/off' columns: ratio to activation_checkpointing=False (step time: the cost; memory: the saving).
act MiB: per rank (the largest), bytes of tensors made in forward still alive when backward starts (the activations
  kept for backward; parameters excluded). peak MiB: largest total of tensors made during forward + backward alive at
  once (activations, temporaries, gradients; parameters and optimizer states made before the step are not counted).
  RSS MiB: peak resident memory of the process during that step (the largest rank; it includes torch itself, ~300
  MiB, and the allocator keeps freed memory, so small models barely move it).
Losses are equal across configurations: checkpointing recomputes the same ops."""


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--devices", type=int, default=2, help="processes (= data-parallel size) per run")
    parser.add_argument("--zero-stage", type=int, default=2, choices=(0, 1, 2, 3))
    parser.add_argument("--precision", type=str, default="32-true", help="e.g. 32-true, bf16-mixed, 16-mixed")
    demo_gpt.add_run_args(parser, steps=12, warmup=2, repeats=1, block_size=128)
    parser.add_argument("--only", type=str, default="", help=f"comma-separated subset of {','.join(CONFIGS)}")
    args = demo_gpt.parse_run_args(parser, argv)
    names = demo_gpt.select(parser, args["only"], CONFIGS)
    demo_gpt.preload()
    jobs = {name: (fit_job, args["devices"], (name, args)) for name in names}
    print_report(run_interleaved(jobs, args["repeats"], args["timeout"], args["verbose"]), args)


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
