"""Pooling a configuration's repeats into medians, and the ratios to its peer with how far they can be trusted.

The statistics every table rests on, computed the same way for every script: ``summarize`` takes per step the
slowest rank's wall time and the ranks' mean CPU time, drops the warm-up steps and pools the repeats; ``ratio`` is
the median of the per-repeat ratios to a peer (interleaved repeats: the same repeat, the same load) with their range
(the spread of the noise); ``median_interval`` is a distribution-free interval for such a median.
"""

from __future__ import annotations

import math
import statistics
from typing import Any

CONFIDENCE = 0.95  # of the intervals `report.interval_table` prints
DECIDES = 0.9  # the least coverage from which an interval decides a target (5 repeats give 93.8%)


def summarize(runs: list[list[dict[str, Any]]], warmup: int) -> dict[str, Any]:
    """Pool a configuration's repeats: per step the slowest rank's wall time and the ranks' mean CPU time.

    ``median``/``cpu`` (and ``iter``/``iter_cpu`` where the probe had them: start to next start) over all repeats;
    ``run_medians``/``run_cpu`` (``run_iter``/``run_iter_cpu``) per repeat, for ``ratio``; ``rank0``: global rank
    0's output of the first repeat, for what a script returns beside the timings.
    """
    first = runs[0]
    memories = [o["memory"] for o in first if o.get("memory")]
    out: dict[str, Any] = {
        "memory": max(memories, key=lambda m: sum(v for v in m.values() if isinstance(v, int))) if memories else None,
        "comm": first[0].get("comm"),
        "loss": first[0].get("loss"),
        "rank0": first[0],
    }
    for wall_key, cpu_key, name, cpu_name in (
        ("times", "cpu_times", "median", "cpu"),
        ("iter_times", "iter_cpu_times", "iter", "iter_cpu"),
    ):
        if not all(o.get(wall_key) for outputs in runs for o in outputs):
            continue
        per_run = [
            (
                [max(s) for s in zip(*(o[wall_key] for o in outputs))][warmup:],
                [statistics.mean(s) for s in zip(*(o[cpu_key] for o in outputs))][warmup:],
            )
            for outputs in runs
        ]
        out[name] = statistics.median(w for wall, _ in per_run for w in wall)
        out[cpu_name] = statistics.median(c for _, cpu in per_run for c in cpu)
        out[f"run_{'medians' if name == 'median' else name}"] = [statistics.median(wall) for wall, _ in per_run]
        out[f"run_{cpu_name}"] = [statistics.median(cpu) for _, cpu in per_run]
        if name == "median":
            out["min"] = min(w for wall, _ in per_run for w in wall)
    if all(o.get("thread_times") for outputs in runs for o in outputs):
        per_run_thread = [
            [statistics.mean(s) for s in zip(*(o["thread_times"] for o in outputs))][warmup:] for outputs in runs
        ]
        out["thread"] = statistics.median(t for run in per_run_thread for t in run)
        out["run_thread"] = [statistics.median(run) for run in per_run_thread]
    phases = [
        tuple(map(statistics.mean, zip(*s)))
        for outputs in runs
        if all(len(o.get("phases") or []) == len(o["times"]) for o in outputs)
        for s in list(zip(*(o["phases"] for o in outputs)))[warmup:]
    ]
    out["phases"] = [statistics.median(column) for column in zip(*phases)] if phases else []
    # Outside the step's forward, backward and optimizer step (which partition it): from each rank's step end to its
    # next step's start, the loop's, the data's and the hooks' own time (the mean over ranks; median over steps).
    outside = [
        statistics.mean(o["iter_times"][i] - o["times"][i] for o in outputs)
        for outputs in runs
        if all(o.get("iter_times") for o in outputs)
        for i in range(warmup, min(min(len(o["iter_times"]), len(o["times"])) for o in outputs))
    ]
    out["outside"] = statistics.median(outside) if outside else None
    return out


def ratio(
    results: dict[str, dict[str, Any]], name: str, peer: str, key: str = "run_medians"
) -> tuple[float, float, float]:
    """Median, min and max over repeats of ``name``'s time / ``peer``'s time in the same repeat (interleaved)."""
    pairs = repeat_ratios(results, name, peer, key)
    return statistics.median(pairs), min(pairs), max(pairs)


def repeat_ratios(results: dict[str, dict[str, Any]], name: str, peer: str, key: str = "run_medians") -> list[float]:
    """``name``'s time / ``peer``'s time in each repeat (the same repeat: interleaved)."""
    return [a / b for a, b in zip(results[name][key], results[peer][key])]


def median_interval(values: list[float], confidence: float = CONFIDENCE) -> tuple[float, float, float]:
    """A distribution-free interval for the median of ``values``: the order statistics ``x(k)`` and ``x(n+1-k)`` with
    the largest ``k`` whose coverage (a binomial sum, no assumption on the distribution) is at least ``confidence``.
    Returns ``(low, high, coverage)``; with too few values for ``confidence``, the min and max and their coverage.
    E.g. 15 values: the 4th and 12th smallest, 96.5%; 5 values: the min and max, 93.8%."""
    ordered, n = sorted(values), len(values)
    interval = (ordered[0], ordered[-1], 1 - 2 * 0.5**n)
    for k in range(2, (n + 1) // 2 + 1):
        coverage = 1 - 2 * sum(math.comb(n, i) for i in range(k)) / 2**n
        if coverage < confidence:
            break
        interval = (ordered[k - 1], ordered[n - k], coverage)
    return interval


def ring_fraction(world: int) -> float:
    return (world - 1) / world if world > 1 else 0.0
