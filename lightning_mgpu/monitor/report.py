"""The scaling report: built from every rank's measurements, written as ``scaling_report.json`` and ``.png``.

``FIELDS`` documents every field of the JSON file; the file carries it under ``"fields"``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, TypedDict

from lightning_mgpu.monitor.diagnose import diagnose
from lightning_mgpu.parallel.pipeline import bubble_fraction

REPORT_VERSION = 1
MIB = 2**20
_MEMORY_PARTS = ("parameters", "gradients", "optimizer", "activations")

FIELDS = {
    "version": "format version of this file",
    "strategy": "the Trainer's strategy class",
    "layout": "HybridStrategy's degrees {data_parallel_size, tensor_parallel_size, pipeline_parallel_size,"
    " zero_stage, context_parallel_size}; null with other strategies",
    "options": "HybridStrategy options that the diagnoses read (activation_checkpointing, pipeline_schedule, ...)",
    "world_size": "processes in the job",
    "data_parallel_replicas": "ranks reading distinct samples (the data-parallel size)",
    "device": "the device type and name of global rank 0",
    "precision": "the Trainer's precision",
    "every_n_steps": "a step in every this many is measured (after `warmup_steps`)",
    "steps_measured": "number of measured steps",
    "throughput": "per second over the measured steps: tokens_per_s and samples_per_s (whole job),"
    " flops_per_step (model FLOPs of one optimizer step, the whole job; 6 x parameters x tokens unless"
    " given), flops_per_s, peak_flops_per_device and peak_source (table or measured), and mfu ="
    " flops_per_s / (peak_flops_per_device x world_size); model_parameters",
    "time_split": "mean over ranks and measured steps: step_s (wall seconds of one step, data fetch included),"
    " parts_s (seconds per part: compute, comm_<axis> = exposed communication per mesh axis (tp, pp,"
    " dp, ...; sync = collectives over every rank when there is a mesh, mostly waiting for the"
    " slowest rank; 'other' = groups outside the mesh), bubble (waiting for a pipeline peer), data_wait,"
    " optimizer (optimizer step and gradient clipping, minus their communication), other (the"
    " training loop, hooks, logging)); fractions = parts_s / step_s, adding up to 1",
    "communication": "per axis, seconds per step: exposed_s (the training thread blocked in collectives and their"
    " waits) and overlapped_s (asynchronous collectives in flight while the thread computed, from"
    " the return of their issue to the start of their wait: an upper bound)",
    "pipeline": "with pipeline parallelism: schedule, pp, stages, num_microbatches, measured_bubble (bubble /"
    " (bubble + compute + comm_pp) of a step, mean over ranks) and analytic_bubble (the schedule's"
    " theory: (p-1)/(m+p-1), or (p-1)/(v*m+p-1) with v stages per rank); null otherwise",
    "memory": "per rank, bytes: parameters, gradients and optimizer (this rank's shards), activations (saved for"
    " backward in one step), peak (CUDA max allocated, or the process's peak RSS on CPU: peak_kind) and"
    " capacity (the GPU's memory, or host RAM / local processes)",
    "per_rank": "per rank: step_s and parts_s as in time_split, for that rank alone",
    "steps": "per measured step: step (batch index), wall_s and parts_s (mean over ranks), timed_calls (the most"
    " collectives, waits and data fetches one rank timed)",
    "experts": "models with mixture-of-experts layers: per layer, tokens (the (token, expert) assignments each expert"
    " got over all training steps, summed over data-parallel and expert-parallel ranks) and max_over_mean"
    " (1 = balanced); null otherwise",
    "diagnoses": "list of {kind, message, change}: data_bound, communication_bound_<axis>, imbalance,"
    " bubble_above_theory,"
    " memory_tight, memory_headroom",
    "fields": "this documentation",
}


class PipelineInfo(TypedDict):
    """The pipeline's shape, from the strategy (``context["pipeline"]``)."""

    schedule: str
    pp: int
    stages: int
    num_microbatches: int


class ExpertLoad(TypedDict):
    tokens: list[int]
    max_over_mean: float | None


class StepSummary(TypedDict):
    step: int
    wall_s: float
    parts_s: dict[str, float]
    timed_calls: int


class RankSummary(TypedDict):
    rank: int
    step_s: float
    parts_s: dict[str, float]


class Throughput(TypedDict):
    tokens_per_s: float
    samples_per_s: float
    model_parameters: int
    flops_per_step: float
    flops_per_s: float
    peak_flops_per_device: float | None
    peak_source: str | None
    mfu: float | None


def build_report(context: dict[str, Any], ranks: list[dict[str, Any]]) -> dict[str, Any]:
    """Combine the context of global rank 0 with every rank's measurements (ordered by rank)."""
    steps = _steps(ranks)
    parts = _mean_parts([s["parts_s"] for s in steps])
    step_s = sum(s["wall_s"] for s in steps) / len(steps) if steps else 0.0
    fractions = {k: v / step_s for k, v in parts.items()} if step_s > 0 else {}
    report: dict[str, Any] = {
        "version": REPORT_VERSION,
        **{
            k: context[k]
            for k in (
                "strategy",
                "layout",
                "options",
                "world_size",
                "data_parallel_replicas",
                "device",
                "precision",
                "every_n_steps",
            )
        },
        "steps_measured": len(steps),
        "throughput": _throughput(context, ranks, step_s),
        "time_split": {"step_s": step_s, "parts_s": parts, "fractions": fractions},
        "communication": _communication(ranks, parts),
        "pipeline": _pipeline(context.get("pipeline"), parts),
        "memory": [dict(rank=r["rank"], **r["memory"]) for r in ranks],
        "per_rank": [_rank_summary(r) for r in ranks],
        "steps": steps,
        "experts": _experts(ranks),
    }
    report["diagnoses"] = diagnose(report)
    report["fields"] = FIELDS
    return report


def _experts(ranks: list[dict[str, Any]]) -> dict[str, ExpertLoad] | None:
    """Per MoE layer: tokens routed to each expert, summed over the ranks (all training steps), and max / mean."""
    layers: dict[str, list[int]] = {}
    for rank in ranks:
        for name, counts in rank.get("expert_tokens", {}).items():
            layers[name] = [a + b for a, b in zip(layers.get(name, [0] * len(counts)), counts)]
    return {
        name: {"tokens": counts, "max_over_mean": max(counts) * len(counts) / sum(counts) if sum(counts) else None}
        for name, counts in layers.items()
    } or None


def _steps(ranks: list[dict[str, Any]]) -> list[StepSummary]:
    common = set.intersection(*({s["step"] for s in r["steps"]} for r in ranks)) if ranks else set()
    steps: list[StepSummary] = []
    for index in sorted(common):
        records = [next(s for s in r["steps"] if s["step"] == index) for r in ranks]
        steps.append(
            {
                "step": index,
                "wall_s": sum(s["wall_s"] for s in records) / len(records),
                "parts_s": _mean_parts([s["parts_s"] for s in records]),
                "timed_calls": max(s.get("timed_calls", 0) for s in records),
            }
        )
    return steps


def _mean_parts(records: list[dict[str, float]]) -> dict[str, float]:
    names = sorted({name for record in records for name in record})
    return {name: sum(r.get(name, 0.0) for r in records) / len(records) for name in names} if records else {}


def _rank_summary(rank: dict[str, Any]) -> RankSummary:
    steps = rank["steps"]
    wall = sum(s["wall_s"] for s in steps) / len(steps) if steps else 0.0
    return {"rank": rank["rank"], "step_s": wall, "parts_s": _mean_parts([s["parts_s"] for s in steps])}


def _throughput(context: dict[str, Any], ranks: list[dict[str, Any]], step_s: float) -> Throughput:
    first = ranks[0]["steps"] if ranks else []
    replicas = context["data_parallel_replicas"]
    samples = replicas * sum(s["samples"] for s in first) / len(first) if first else 0.0
    tokens = replicas * sum(s["tokens"] for s in first) / len(first) if first else 0.0
    held: dict[int, int] = {}
    for rank in ranks:  # one rank per pipeline stage holds that stage's parameters (at full size)
        held.setdefault(rank["pp_rank"], rank["params_held"])
    parameters = sum(held.values())
    flops = context.get("flops_per_step") or 6.0 * parameters * tokens
    per_s = 1.0 / step_s if step_s > 0 else 0.0
    peak = context.get("peak_flops_per_device")
    return {
        "tokens_per_s": tokens * per_s,
        "samples_per_s": samples * per_s,
        "model_parameters": parameters,
        "flops_per_step": flops,
        "flops_per_s": flops * per_s,
        "peak_flops_per_device": peak,
        "peak_source": context.get("peak_source"),
        "mfu": flops * per_s / (peak * context["world_size"]) if peak else None,
    }


def _communication(ranks: list[dict[str, Any]], parts: dict[str, float]) -> dict[str, dict[str, float]]:
    hidden = _mean_parts([s.get("overlapped_s", {}) for r in ranks for s in r["steps"]])
    axes = sorted({k[len("comm_") :] for k in parts if k.startswith("comm_")} | set(hidden))
    return {axis: {"exposed_s": parts.get(f"comm_{axis}", 0.0), "overlapped_s": hidden.get(axis, 0.0)} for axis in axes}


def _pipeline(info: PipelineInfo | None, parts: dict[str, float]) -> dict[str, object] | None:
    if not info:
        return None
    busy = parts.get("bubble", 0.0) + parts.get("compute", 0.0) + parts.get("comm_pp", 0.0)
    return {
        **info,
        "measured_bubble": parts.get("bubble", 0.0) / busy if busy > 0 else None,
        "analytic_bubble": bubble_fraction(info["pp"], info["num_microbatches"], max(1, info["stages"] // info["pp"])),
    }


# ------------------------------------------------------------------------------------------------------ outputs
def format_table(report: dict[str, Any]) -> str:
    """The end-of-fit summary: throughput, the split of a step, memory per rank and the diagnoses."""
    t, split = report["throughput"], report["time_split"]
    layout = report["layout"]
    where = (
        (
            f"dp={layout['data_parallel_size']} x tp={layout['tensor_parallel_size']} x"
            f" pp={layout['pipeline_parallel_size']} (zero_stage={layout['zero_stage']})"
        )
        if layout
        else report["strategy"]
    )
    lines = [f"ScalingMonitor: {where}, {report['world_size']} processes, {report['steps_measured']} measured steps"]
    mfu = f"{t['mfu']:.2%}" if t["mfu"] is not None else "n/a"
    lines.append(
        f"  {t['tokens_per_s']:,.0f} tokens/s  {t['samples_per_s']:,.1f} samples/s  "
        f"{t['flops_per_s'] / 1e9:,.2f} GFLOP/s  MFU {mfu} ({t['peak_source']})"
    )
    lines.append(f"  {'part':<14}{'ms/step':>10}{'share':>9}")
    for name, seconds in sorted(split["parts_s"].items(), key=lambda item: -item[1]):
        lines.append(f"  {name:<14}{seconds * 1e3:>10.2f}{split['fractions'].get(name, 0.0):>9.1%}")
    lines.append(f"  {'step':<14}{split['step_s'] * 1e3:>10.2f}{sum(split['fractions'].values()):>9.1%}")
    overlapped = {axis: c["overlapped_s"] for axis, c in report["communication"].items() if c["overlapped_s"] > 0}
    if overlapped:
        lines.append(
            "  overlapped with compute (ms/step, at most): "
            + "  ".join(f"{axis} {seconds * 1e3:.2f}" for axis, seconds in sorted(overlapped.items()))
        )
    pipeline = report["pipeline"]
    if pipeline and pipeline["measured_bubble"] is not None:
        lines.append(
            f"  pipeline bubble: measured {pipeline['measured_bubble']:.1%}, {pipeline['schedule']} theory"
            f" {pipeline['analytic_bubble']:.1%} (p={pipeline['pp']}, m={pipeline['num_microbatches']})"
        )
    lines.append("  memory MiB: " + "rank " + " ".join(f"{p[:6]:>8}" for p in (*_MEMORY_PARTS, "peak")))
    for rank in report["memory"]:
        values = " ".join(f"{rank.get(p, 0) / MIB:>8.1f}" for p in (*_MEMORY_PARTS, "peak"))
        lines.append(f"             {rank['rank']:>4} {values}")
    for name, layer in (report.get("experts") or {}).items():
        lines.append(f"  experts {name}: tokens {layer['tokens']} (max/mean {layer['max_over_mean'] or 0:.2f})")
    for item in report["diagnoses"]:
        lines.append(f"  ! {item['message']} Try: {item['change']}")
    return "\n".join(lines)


def write_json(report: dict[str, Any], path: Path) -> Path:
    path.write_text(json.dumps(report, indent=2, default=str))
    return path


def write_plot(report: dict[str, Any], path: Path) -> Path | None:
    """Stacked time split per measured step, and memory per rank; ``None`` without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg", force=False)
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    steps = report["steps"]
    names = sorted({n for s in steps for n in s["parts_s"]}, key=lambda n: -report["time_split"]["parts_s"].get(n, 0))
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    x = list(range(len(steps)))
    bottom = [0.0] * len(steps)
    for name in names:
        heights = [max(0.0, s["parts_s"].get(name, 0.0)) * 1e3 for s in steps]
        left.bar(x, heights, bottom=bottom, label=name)
        bottom = [b + h for b, h in zip(bottom, heights)]
    left.plot(x, [s["wall_s"] * 1e3 for s in steps], "k.", label="wall")
    left.set_xticks(x, [str(s["step"]) for s in steps], fontsize=7)
    left.set(xlabel="step (batch index)", ylabel="ms (mean over ranks)", title="Time split per step")
    left.legend(fontsize=7)
    ranks = report["memory"]
    bottom = [0.0] * len(ranks)
    for part in _MEMORY_PARTS:
        heights = [r.get(part, 0) / MIB for r in ranks]
        right.bar([r["rank"] for r in ranks], heights, bottom=bottom, label=part)
        bottom = [b + h for b, h in zip(bottom, heights)]
    right.plot(
        [r["rank"] for r in ranks],
        [r.get("peak", 0) / MIB for r in ranks],
        "kv",
        label=f"peak ({ranks[0].get('peak_kind', '')})" if ranks else "peak",
    )
    right.set_xticks([r["rank"] for r in ranks])
    right.set(xlabel="rank", ylabel="MiB", title="Memory per rank")
    right.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
