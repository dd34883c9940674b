"""``lightning-mgpu bench``: measure every valid layout of a model on this machine, rank them, and show how the
best one scales from 1 to N devices.

Each layout trains a few steps under :class:`~lightning_mgpu.HybridStrategy` with a
:class:`~lightning_mgpu.ScalingMonitor`, whose ``scaling_report.json`` gives its throughput and time split. The
batch per data-parallel rank is fixed (``--batch-size``), so more data-parallel ranks process more samples per step
(weak scaling); the scaling efficiency at ``n`` devices is ``tokens/s(n) / (n x tokens/s(1))``. Where the planner
(``lightning_mgpu.planner``) is present, its prediction stands beside each measurement.
"""

from __future__ import annotations

import argparse
import contextlib
import inspect
import json
import logging
import math
import os
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from lightning_mgpu.cli.errors import UsageError, non_negative_int, positive_int
from lightning_mgpu.layout import ParallelLayout, degree_splits
from lightning_mgpu.options import ParallelOptions
from lightning_mgpu.parallel import pipeline

_SHARE_COLUMNS = ("compute", "comm", "bubble", "data_wait", "optimizer", "other")


def add_bench_arguments(bench: argparse.ArgumentParser) -> None:
    bench.description = (
        "Train a few steps of every valid (dp, tp, pp) layout for 1..N devices on this machine, rank the layouts by"
        " measured tokens/s with their time split, and show the scaling efficiency of the best layout at each device"
        " count. Writes bench.json and bench.png (with the monitor extra: matplotlib) to --out."
    )
    bench.add_argument("--module", required=True, help="the LightningModule, 'package.module:Class'")
    bench.add_argument("--init-args", default=None, help="JSON keyword arguments for the module")
    bench.add_argument("--datamodule", default=None, help="a LightningDataModule, 'package.module:Class'")
    bench.add_argument("--datamodule-args", default=None, help="JSON keyword arguments for the datamodule")
    bench.add_argument("--devices", type=positive_int, required=True, help="the most processes (CPU) or GPUs to use")
    bench.add_argument(
        "--device-counts",
        default="all",
        help="comma-separated device counts to sweep ('all' = 1..N; the largest is always N)",
    )
    bench.add_argument("--accelerator", default="cpu", help="Lightning's accelerator: cpu, gpu, ...")
    bench.add_argument(
        "--batch-size",
        type=positive_int,
        default=8,
        help="samples per data-parallel rank (given to the datamodule's `batch_size`)",
    )
    bench.add_argument("--steps", type=positive_int, default=5, help="training steps per layout, warm-up included")
    bench.add_argument(
        "--warmup-steps", type=non_negative_int, default=2, help="steps not measured at the start of each run"
    )
    bench.add_argument(
        "--zero-stage", type=int, default=0, choices=(0, 1, 2, 3), help="ZeRO stage where there is data parallelism"
    )
    bench.add_argument("--pipeline-schedule", default="1F1B", help="the schedule of the layouts with pp > 1")
    bench.add_argument("--precision", default="32-true", help="Lightning's precision: 32-true, bf16-mixed, ...")
    bench.add_argument("--out", default="bench_results", help="directory for bench.json, bench.png and each run")
    bench.set_defaults(run=run_bench)


def run_bench(args: argparse.Namespace) -> int:
    from lightning_mgpu.planner.model_spec import check_arguments, load_class

    counts = _device_counts(args.devices, args.device_counts)
    if args.warmup_steps >= args.steps:
        raise UsageError(
            f"--warmup-steps {args.warmup_steps} leaves no measured step of --steps {args.steps}: give more --steps."
        )
    pipeline.check_options(ParallelOptions(pipeline_schedule=args.pipeline_schedule))
    module_cls = load_class(args.module)
    datamodule_cls = load_class(args.datamodule, "--datamodule") if args.datamodule else None
    module_args, datamodule_args = (
        _json_object(args.init_args, "--init-args"),
        _json_object(args.datamodule_args, "--datamodule-args"),
    )
    check_arguments(module_cls, module_args, "--init-args")
    if datamodule_cls is not None:
        check_arguments(datamodule_cls, _datamodule_kwargs(datamodule_cls, datamodule_args, args), "--datamodule-args")
    shapes = _shapes(module_cls, module_args)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    with _quiet_lightning():
        results = _sweep(args, counts, shapes, module_cls, module_args, datamodule_cls, datamodule_args, out)
    _add_predictions(args, results)
    scaling = _scaling(results)
    print(format_results(results, scaling))
    summary = {
        "args": vars(args) | {"run": None},
        "runs": results,
        "scaling": scaling,
        "elapsed_s": time.perf_counter() - started,
    }
    (out / "bench.json").write_text(json.dumps(summary, indent=2, default=str))
    plot = _plot(results, scaling, out / "bench.png")
    print(
        f"bench: {len(results)} runs in {summary['elapsed_s']:.0f} s; wrote {out / 'bench.json'}"
        + (f" and {plot}" if plot else "")
    )
    return 0 if any("tokens_per_s" in r for r in results) else 1


@contextlib.contextmanager
def _quiet_lightning() -> Iterator[None]:
    """Lightning's info lines off during the sweep (one fit per layout), back as they were after it."""
    loggers = [logging.getLogger(name) for name in ("lightning.pytorch", "lightning.fabric")]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)


def _sweep(
    args: argparse.Namespace,
    counts: list[int],
    shapes: dict[str, int],
    module_cls: type,
    module_args: dict[str, Any],
    datamodule_cls: type | None,
    datamodule_args: dict[str, Any],
    out: Path,
) -> list[dict[str, Any]]:
    """Every layout of every device count, trained and measured in turn."""
    results = []
    for n in counts:
        for layout in _layouts(n, shapes, args.zero_stage):
            name = f"dp{layout.dp}_tp{layout.tp}_pp{layout.pp}"
            print(f"bench: {name} on {n} device{'s' if n > 1 else ''} ...", flush=True)
            run: dict[str, Any] = {"devices": n, "name": name, "zero_stage": layout.zero_stage}
            run |= {"dp": layout.dp, "tp": layout.tp, "pp": layout.pp}
            try:
                report = _measure(args, module_cls, module_args, datamodule_cls, datamodule_args, layout, out / name)
                run.update(_summary(report))
            except Exception as error:  # one layout failing (memory, a model constraint) does not stop the sweep
                first_line = (str(error).strip().splitlines() or [""])[0][:200]
                run["error"] = f"{type(error).__name__}: {first_line}"
            results.append(run)
    return results


# ------------------------------------------------------------------------------------------------ the sweep
def _device_counts(devices: int, text: str) -> list[int]:
    if isinstance(devices, bool) or devices < 1:
        raise UsageError(f"--devices must be a positive integer, got {devices}.")
    if text == "all":
        return list(range(1, devices + 1))
    try:
        counts = sorted({int(c) for c in text.split(",") if c.strip()} | {devices})
    except ValueError:
        raise UsageError(f"--device-counts must be 'all' or comma-separated integers, got {text!r}.") from None
    if counts[0] < 1 or counts[-1] > devices:
        raise UsageError(f"--device-counts {text!r} must lie in 1..{devices} (--devices).")
    return counts


def _json_object(text: str | None, flag: str) -> dict[str, Any]:
    if not text:
        return {}
    try:
        value = json.loads(text)
    except json.JSONDecodeError as error:
        raise UsageError(f"{flag} is not valid JSON ({error}): give e.g. '{{\"n_layer\": 4}}'.") from None
    if not isinstance(value, dict):
        raise UsageError(f"{flag} must be a JSON object of keyword arguments, got {text!r}.")
    return value


def _shapes(module_cls: type, module_args: dict[str, Any]) -> dict[str, int]:
    """Heads and blocks of the model (built on the meta device), to skip layouts it cannot run."""
    try:
        from lightning_mgpu.planner.model_spec import build_on_meta, spec_from_module

        spec = spec_from_module(build_on_meta(module_cls, module_args))
        return {"heads": spec.heads, "layers": spec.layers}
    except Exception:  # no planner, or a model it cannot read: every layout is tried and failures are reported
        return {}


def _layouts(n: int, shapes: dict[str, int], zero_stage: int) -> list[ParallelLayout]:
    """The layouts of ``n`` devices that the model's heads and layers allow (all of them for an unread model), at
    ``zero_stage`` where there is data parallelism."""
    return [
        ParallelLayout(dp, tp, pp, zero_stage if dp > 1 else 0)
        for dp, tp, pp in degree_splits(n)
        if not (shapes.get("heads") and shapes["heads"] % tp) and not (shapes.get("layers") and pp > shapes["layers"])
    ]


def _measure(
    args: argparse.Namespace,
    module_cls: type,
    module_args: dict[str, Any],
    datamodule_cls: type | None,
    datamodule_args: dict[str, Any],
    layout: ParallelLayout,
    out: Path,
) -> dict[str, Any]:
    import lightning as L

    from lightning_mgpu import HybridStrategy, ScalingMonitor

    L.seed_everything(1234, verbose=False)
    strategy = HybridStrategy(
        data_parallel_size=layout.dp,
        tensor_parallel_size=layout.tp,
        pipeline_parallel_size=layout.pp,
        zero_stage=layout.zero_stage,
        pipeline_schedule=args.pipeline_schedule,
        start_method="fork",
    )
    monitor = ScalingMonitor(warmup_steps=args.warmup_steps, dirpath=out, verbose=False)
    trainer = L.Trainer(
        accelerator=args.accelerator,
        devices=layout.world_size,
        strategy=strategy,
        precision=args.precision,
        max_steps=args.steps,
        callbacks=[monitor],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        num_sanity_val_steps=0,
    )
    model = module_cls(**module_args)
    datamodule = None
    if datamodule_cls is not None:
        datamodule = datamodule_cls(**_datamodule_kwargs(datamodule_cls, datamodule_args, args))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(model, datamodule=datamodule)
    return json.loads((out / "scaling_report.json").read_text())


def _datamodule_kwargs(datamodule_cls: type, datamodule_args: dict[str, Any], args: argparse.Namespace) -> dict:
    """``--datamodule-args`` with ``--batch-size`` as its ``batch_size`` where it takes one."""
    kwargs = dict(datamodule_args)
    if "batch_size" in inspect.signature(datamodule_cls).parameters:
        kwargs.setdefault("batch_size", args.batch_size)
    return kwargs


def _summary(report: dict[str, Any]) -> dict[str, Any]:
    fractions = report["time_split"]["fractions"]
    shares = dict.fromkeys(_SHARE_COLUMNS, 0.0)
    for name, share in fractions.items():
        shares["comm" if name.startswith("comm_") else name if name in shares else "other"] += share
    return {
        "tokens_per_s": report["throughput"]["tokens_per_s"],
        "samples_per_s": report["throughput"]["samples_per_s"],
        "mfu": report["throughput"]["mfu"],
        "step_s": report["time_split"]["step_s"],
        "shares": shares,
        "comm_by_axis": {k[len("comm_") :]: v for k, v in fractions.items() if k.startswith("comm_")},
        "bubble": (report["pipeline"] or {}).get("measured_bubble"),
        "analytic_bubble": (report["pipeline"] or {}).get("analytic_bubble"),
        "diagnoses": [d["kind"] for d in report["diagnoses"]],
    }


def _add_predictions(args: argparse.Namespace, results: list[dict[str, Any]]) -> None:
    """The planner's tokens/s for each layout on this machine, where the planner can read the model."""
    try:
        import torch

        from lightning_mgpu.monitor.measures import device_peak_flops
        from lightning_mgpu.planner import (
            ClusterSpec,
            Efficiency,
            Layout,
            Training,
            estimate,
            microbatching_for,
            spec_from_path,
        )

        spec = spec_from_path(args.module, args.init_args)
        peak, _ = device_peak_flops(torch.device(args.accelerator), args.precision)
    except Exception:
        return
    if peak is None:  # no peak known for this device: nothing to predict with
        return
    for run in results:
        n, dp, tp, pp = run["devices"], run["dp"], run["tp"], run["pp"]
        try:
            cluster = ClusterSpec(
                gpus=n,
                gpus_per_node=n,
                memory_gb=64,
                peak_tflops=peak / 1e12,
                intra_node_gbps=2.0,
                inter_node_gbps=2.0,
                hbm_gbps=10.0,
                reserved_gb=0.0,
                name=args.accelerator,
            )
            layout = ParallelLayout(dp, tp, pp, run["zero_stage"])  # as the sweep ran it (``_measure``)
            options = ParallelOptions(pipeline_schedule=args.pipeline_schedule) if pp > 1 else ParallelOptions()
            training = Training(global_batch=args.batch_size * dp, precision=args.precision)
            microbatching = microbatching_for(layout, options, training.global_batch)
            planned = Layout.from_strategy(layout, options, microbatching)
            predicted = estimate(spec, cluster, training, planned, Efficiency())
            run["predicted_tokens_per_s"] = predicted.tokens_per_s
            run["predicted_bubble"] = predicted.bubble
        except Exception:
            continue


def _scaling(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    best: dict[int, dict[str, Any]] = {}
    for run in results:
        if "tokens_per_s" in run and run["tokens_per_s"] > best.get(run["devices"], {}).get("tokens_per_s", -1):
            best[run["devices"]] = run
    base = best.get(1, {}).get("tokens_per_s")
    return [
        {
            "devices": n,
            "layout": run["name"],
            "tokens_per_s": run["tokens_per_s"],
            "efficiency": run["tokens_per_s"] / (n * base) if base else None,
        }
        for n, run in sorted(best.items())
    ]


# ---------------------------------------------------------------------------------------------------- output
def format_results(results: list[dict[str, Any]], scaling: list[dict[str, Any]]) -> str:
    ranked = sorted(results, key=lambda r: (-r["devices"], -r.get("tokens_per_s", -math.inf)))
    predicted = any("predicted_tokens_per_s" in r for r in results)
    head = (
        f"{'#':>2} {'layout':<14}{'dev':>4}{'tokens/s':>11}{'step ms':>9}"
        + "".join(f"{c[:7]:>8}" for c in _SHARE_COLUMNS)
        + (f"{'planner':>11}" if predicted else "")
        + "  notes"
    )
    lines = ["bench: layouts ranked by measured throughput (shares of a step)", head]
    rank, devices = 0, None
    for run in ranked:
        rank = rank + 1 if run["devices"] == devices else 1
        devices = run["devices"]
        if "tokens_per_s" not in run:
            lines.append(f"{'-':>2} {run['name']:<14}{run['devices']:>4}  failed: {run['error']}")
            continue
        shares = "".join(f"{run['shares'][c]:>8.1%}" for c in _SHARE_COLUMNS)
        plan = (
            f"{run['predicted_tokens_per_s']:>11,.0f}"
            if "predicted_tokens_per_s" in run
            else (f"{'':>11}" if predicted else "")
        )
        notes = []
        if run["bubble"] is not None:
            notes.append(f"bubble {run['bubble']:.0%} (theory {run['analytic_bubble']:.0%})")
        notes += run["diagnoses"]
        lines.append(
            f"{rank:>2} {run['name']:<14}{run['devices']:>4}{run['tokens_per_s']:>11,.0f}"
            f"{run['step_s'] * 1e3:>9.1f}{shares}{plan}  {', '.join(notes)}"
        )
    lines.append("scaling of the best layout per device count (efficiency = tokens/s(n) / (n x tokens/s(1))):")
    busy = _busy_machine()
    if busy:
        lines.append(f"   ({busy})")
    for row in scaling:
        eff = f"{row['efficiency']:.0%}" if row["efficiency"] is not None else "n/a"
        lines.append(
            f"   {row['devices']:>3} devices  {row['layout']:<14}{row['tokens_per_s']:>11,.0f} tokens/s"
            f"  efficiency {eff}"
        )
    return "\n".join(lines)


def _busy_machine() -> str:
    """A warning when other work shares this machine's CPUs: then more processes win a larger share of them."""
    try:
        load, cores = os.getloadavg()[0], os.cpu_count() or 1
    except OSError:
        return ""
    if load <= cores:
        return ""
    return (
        f"load average {load:.1f} on {cores} CPUs: other work shares this machine, so runs with more processes"
        " get a larger share of it and efficiencies can exceed 100%; compare layouts within one run"
    )


def _plot(results: list[dict[str, Any]], scaling: list[dict[str, Any]], path: Path) -> Path | None:
    try:
        import matplotlib

        matplotlib.use("Agg", force=False)
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    done = [r for r in results if "tokens_per_s" in r]
    left.scatter([r["devices"] for r in done], [r["tokens_per_s"] for r in done], c="0.6", label="every layout")
    left.plot([s["devices"] for s in scaling], [s["tokens_per_s"] for s in scaling], "o-", label="best layout")
    for s in scaling:
        left.annotate(s["layout"], (s["devices"], s["tokens_per_s"]), fontsize=7)
    predicted = [r for r in done if "predicted_tokens_per_s" in r]
    if predicted:
        left.scatter(
            [r["devices"] for r in predicted],
            [r["predicted_tokens_per_s"] for r in predicted],
            marker="x",
            c="C3",
            label="planner prediction",
        )
    left.set(xlabel="devices", ylabel="tokens/s", title="Throughput")
    left.legend(fontsize=7)
    with_eff = [s for s in scaling if s["efficiency"] is not None]
    right.plot([s["devices"] for s in with_eff], [100 * s["efficiency"] for s in with_eff], "o-")
    right.axhline(100, color="0.7", linestyle="--")
    right.set(xlabel="devices", ylabel="% of linear", title="Scaling efficiency of the best layout")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
