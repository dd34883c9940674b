"""Plain-word diagnoses of a scaling report, each with the concrete change to try."""

from __future__ import annotations

from typing import Any

DATA_BOUND = 0.20  # the data fetch takes more than this share of a step
COMM_BOUND = 0.25  # exposed communication on one axis takes more than this share of a step
BUBBLE_EXCESS = 0.10  # the measured bubble exceeds the schedule's theory by more than this (absolute share)
LOW_MEMORY, HIGH_MEMORY = 0.50, 0.90  # peak memory as a share of what a rank may use

_AXIS_CHANGES = {
    "tp": "lower tensor_parallel_size (and raise data_parallel_size), turn on sequence_parallel=True, and keep"
    " tensor-parallel groups inside one node (tensor_parallel_size dividing the GPUs per node)",
    "pp": "use fewer pipeline stages, or send less between them (a split point with smaller activations via"
    " pipeline_split)",
    "dp": "raise the batch per rank or accumulate_grad_batches so gradients are reduced less often, or use a lower"
    " zero_stage (3 gathers parameters every step; 1 and 2 do not)",
    "ep": "lower expert_parallel_size or raise the batch per rank",
}


def diagnose(report: dict[str, Any]) -> list[dict[str, str]]:
    """The diagnoses that apply to ``report`` (see :mod:`lightning_mgpu.monitor.report`)."""
    found: list[dict[str, str]] = []
    fractions = report["time_split"]["fractions"]
    data = fractions.get("data_wait", 0.0)
    if data > DATA_BOUND:
        found.append(
            {
                "kind": "data_bound",
                "message": f"Data-bound: waiting for the next batch takes {data:.0%} of each step (over"
                f" {DATA_BOUND:.0%}); the devices idle while the DataLoader works.",
                "change": "Give the DataLoader worker processes (num_workers=4 or more, persistent_workers=True,"
                " pin_memory=True on GPU), move decoding/augmentation out of the training process, or"
                " preprocess the data offline.",
            }
        )
    for part, share in sorted(fractions.items(), key=lambda item: -item[1]):
        if part.startswith("comm_") and part != "comm_sync" and share > COMM_BOUND:
            axis = part[len("comm_") :]
            found.append(
                {
                    "kind": f"communication_bound_{axis}",
                    "message": f"Communication-bound on the {axis} axis: exposed {axis} communication takes {share:.0%}"
                    f" of each step (over {COMM_BOUND:.0%}).",
                    "change": _capitalized(_AXIS_CHANGES.get(axis, "check which collectives run on this process group"))
                    + ".",
                }
            )
    sync = fractions.get("comm_sync", 0.0)
    if sync > COMM_BOUND:
        found.append(
            {
                "kind": "imbalance",
                "message": f"Ranks wait for each other: {sync:.0%} of each step passes in job-wide synchronization"
                " (collectives over every rank, such as Lightning's per-step stop-signal broadcast), which"
                " lasts until the slowest rank arrives.",
                "change": "Balance the work per rank: pipeline stages of equal cost (pipeline_split), equal batches per"
                " data-parallel rank (DataLoader(drop_last=True)), no rank-0-only work inside the step.",
            }
        )
    pipeline = report.get("pipeline")
    if pipeline and pipeline.get("measured_bubble") is not None:
        measured, theory = pipeline["measured_bubble"], pipeline["analytic_bubble"]
        if measured > theory + BUBBLE_EXCESS:
            m = pipeline["num_microbatches"]
            found.append(
                {
                    "kind": "bubble_above_theory",
                    "message": f"The pipeline idles {measured:.0%} of its time, more than {pipeline['schedule']}'s"
                    f" theory of {theory:.0%} for {pipeline['pp']} stages and {m} microbatches: stages are"
                    " unbalanced or wait on communication.",
                    "change": "Balance the stages (pipeline_split at other blocks), raise num_microbatches"
                    f" (e.g. {2 * m}), or use an interleaved or zero-bubble schedule (Interleaved1F1B,"
                    " ZBVZeroBubble).",
                }
            )
    found.extend(_memory(report))
    return found


def _capitalized(text: str) -> str:
    return text[:1].upper() + text[1:]


def _memory(report: dict[str, Any]) -> list[dict[str, str]]:
    ranks = [r for r in report["memory"] if r.get("capacity")]
    if not ranks:
        return []
    use = max(r["peak"] / r["capacity"] for r in ranks)
    options = report.get("options", {})
    checkpointing = bool(options.get("activation_checkpointing"))
    zero_stage = (report.get("layout") or {}).get("zero_stage", 0)
    if use > HIGH_MEMORY:
        return [
            {
                "kind": "memory_tight",
                "message": f"Memory is tight: the fullest rank peaks at {use:.0%} of what it may use.",
                "change": "Raise zero_stage (shards optimizer states, then gradients, then parameters), turn on"
                " activation_checkpointing, or lower the batch per rank.",
            }
        ]
    if use < LOW_MEMORY and (checkpointing or zero_stage >= 2):
        drop = []
        if checkpointing:
            drop.append("turn activation_checkpointing off (no recomputation in backward)")
        if zero_stage >= 2:
            drop.append(f"try zero_stage={zero_stage - 1} (fewer collectives per step)")
        return [
            {
                "kind": "memory_headroom",
                "message": f"Memory headroom: the fullest rank peaks at {use:.0%} of what it may use.",
                "change": "Spend it on speed: " + " or ".join(drop) + "; or raise the batch per rank.",
            }
        ]
    return []
