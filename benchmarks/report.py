"""The printed tables: each configuration against its peer, one row per configuration, and the cells they share.

Every script prints with these so that its tables read alike: ``ratio_table`` (each configuration against its peer:
the median of the per-repeat step and CPU-time ratios with their range, against a target), ``thread_table`` and
``interval_table`` beside it (main-thread CPU time; where each median lies and what the run decides), ``table`` (one
row per configuration with a script's own columns, ``memory_columns`` among them) and ``fmt_comm``. The numbers
come from ``stats.py``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from benchmarks.stats import CONFIDENCE, DECIDES, median_interval, ratio, repeat_ratios

MB = 2**20
# (configuration, peer, target): a ratio above the target is flagged; None: no target, the ratio is informative.
Pairs = Sequence[tuple[str, str, float | None]]
Cell = Callable[[str, dict[str, Any]], str]


def ratio_table(
    results: dict[str, dict[str, Any]], pairs: Pairs, title: str = "", span: str = "step"
) -> list[dict[str, Any]]:
    """Print ``name / peer`` step-time and CPU-time ratios (median of per-repeat ratios [min-max]) and the target.

    ``pairs``: ``(name, peer, target)``; a step or CPU ratio above ``target`` is flagged ``MISSED``.
    ``span="iter"``: the times from one step's start to the next instead of the step's own. Returns the rows.
    """
    rows = []
    key, wall_key, cpu_key = (
        ("median", "run_medians", "run_cpu") if span == "step" else ("iter", "run_iter", "run_iter_cpu")
    )
    if title:
        print(title)
    head = (
        f"{'configuration':<22} {'peer':<22} {span + ' ms':>8} {'peer ms':>8} {span + ' ratio':>20}"
        f" {'cpu ratio':>20} {'target':>7}"
    )
    print(head)
    print("-" * len(head))
    for name, peer, target in pairs:
        if name not in results or peer not in results:
            print(f"{name:<22} {peer:<22} (missing)")
            continue
        wall, cpu = ratio(results, name, peer, wall_key), ratio(results, name, peer, cpu_key)
        verdict = (
            ""
            if target is None
            else ", ".join(f"{what} {'ok' if r[0] <= target else 'MISSED'}" for what, r in ((span, wall), ("cpu", cpu)))
        )
        print(
            f"{name:<22} {peer:<22} {results[name][key] * 1e3:8.1f} {results[peer][key] * 1e3:8.1f}"
            f" {_fmt_ratio(wall):>20} {_fmt_ratio(cpu):>20} {'' if target is None else f'<={target:.2f}':>7} {verdict}"
        )
        rows.append({"name": name, "peer": peer, "wall": wall, "cpu": cpu, "target": target})
    return rows


def thread_table(results: dict[str, dict[str, Any]], pairs: Pairs) -> None:
    """Supplementary to ``ratio_table``: the ratio of the ranks' main-thread CPU time per step (median over repeats
    [min-max]). Process CPU time also counts gloo's worker threads, whose polling while a rank waits for its peer
    varies with the machine's load from run to run; the main thread's is the work the rank's step itself did."""
    print("\nmain-thread CPU time per step (the rank's own work, no gloo worker thread), ours / peer:")
    for name, peer, _ in pairs:
        if "run_thread" in results.get(name, {}) and "run_thread" in results.get(peer, {}):
            r = ratio(results, name, peer, "run_thread")
            ms = results[name]["thread"] * 1e3, results[peer]["thread"] * 1e3
            print(f"  {name:<22} {peer:<22} {ms[0]:8.1f} {ms[1]:8.1f} {_fmt_ratio(r):>20}")


def outside_table(results: dict[str, dict[str, Any]], pairs: Pairs) -> None:
    """The per-step time outside the step's forward, backward and optimizer step (the phases, which partition the
    step): from one step's end to the next one's start, what Lightning's loop, the data and the strategy's hooks
    around the step take (median over steps of the ranks' mean), ours beside the peer's."""
    print("\nper-step time between steps (outside forward / backward / optimizer: loop, data, hooks), ms, ours / peer:")
    for name, peer, _ in pairs:
        mine, peers = results.get(name, {}).get("outside"), results.get(peer, {}).get("outside")
        if mine is None or peers is None:
            continue
        print(f"  {name:<22} {peer:<22} {mine * 1e3:8.1f} {peers * 1e3:8.1f}   difference {(mine - peers) * 1e3:+.1f}")


def interval_table(results: dict[str, dict[str, Any]], pairs: Pairs) -> None:
    """For each pair with a target: where the median of its per-repeat ratios lies (``median_interval``), step and
    CPU, and whether this run decides the target: ``met`` (the interval lies below it), ``missed`` (above it) or
    ``undecided`` (it holds the target: another run of the same code may land on either side); below 90% coverage
    (4 repeats or fewer), ``too few repeats``."""
    rows = [(name, peer, target) for name, peer, target in pairs if target is not None]
    rows = [row for row in rows if row[0] in results and row[1] in results]
    if not rows:
        return
    print(f"\nwhere each median lies ({CONFIDENCE:.0%} interval over the repeats' ratios), and what it decides:")
    for name, peer, target in rows:
        cells = []
        for what, key in (("step", "run_medians"), ("cpu", "run_cpu")):
            low, high, coverage = median_interval(repeat_ratios(results, name, peer, key))
            verdict = "met" if high <= target else "missed" if low > target else "undecided"
            verdict = verdict if coverage >= DECIDES else "too few repeats"
            cells.append(f"{what} [{low:.3f}-{high:.3f}] ({coverage:.1%}) {verdict}")
        print(f"  {name:<22} {peer:<22} <={target:.2f}: " + ", ".join(cells))


def table(
    results: dict[str, dict[str, Any]],
    columns: dict[str, Cell],
    title: str = "",
    phases: bool = False,
) -> None:
    """One row per configuration: median step and CPU ms, then ``columns`` (``{header: cell(name, result)}``);
    ``phases``: then forward / backward / optimizer ms per configuration, wall and CPU."""
    if title:
        print(title)
    head = f"{'configuration':<22} {'step ms':>8} {'cpu ms':>7} " + " ".join(columns)
    print(head + "\n" + "-" * len(head))
    for name, r in results.items():
        cells = " ".join(f"{cell(name, r):>{len(header)}}" for header, cell in columns.items())
        print(f"{name:<22} {r['median'] * 1e3:8.1f} {r['cpu'] * 1e3:7.1f} {cells}")
    if phases:
        print("phases, ms (median over steps of the ranks' mean), wall then CPU: forward / backward / optimizer step")
        for name, r in results.items():
            ph = [f"{x * 1e3:.1f}" for x in r["phases"]]
            print(f"  {name:<22} wall {'/'.join(ph[:3]):<18} cpu {'/'.join(ph[3:])}")


def memory_columns(digits: int = 2) -> dict[str, Cell]:
    """``table`` columns: MB per rank of parameters, gradients and optimizer state (the most loaded rank)."""
    return {f"{k[:5]} MB": _memory_cell(k, digits) for k in ("params", "grads", "optim")}


def _memory_cell(key: str, digits: int) -> Cell:
    def cell(name: str, r: dict[str, Any]) -> str:
        return f"{r['memory'][key] / MB:.{digits}f}" if r["memory"] else "-"

    return cell


def _fmt_ratio(r: tuple[float, float, float]) -> str:
    return f"{r[0]:.3f} [{r[1]:.2f}-{r[2]:.2f}]"


def fmt_comm(comm: dict[str, Any] | None) -> str:
    """``AR3 RS2 ...``: collectives per kind (logging syncs of one element included)."""
    if not comm:
        return "?"
    return " ".join(f"{kind}{n}" for kind, n in sorted(comm["counts"].items()))
