"""What a step issues, by phase and module: collectives grouped per block beside an analytic expectation, op counts.

``CommRecorder`` is torch's ``CommDebugMode`` that also keeps, for each collective of one step, its kind, the bytes
of its tensors, its group's size, the phase of the step (told by the step probes: ``forward``, ``backward``,
``optimizer``) and the module that issued it. ``regions`` groups those records per block (``<blocks>.<i>``), outside
the blocks, in the optimizer step, and eager c10d calls (Lightning's ``self.log(..., sync_dist=True)``) apart;
``print_against`` prints them beside an expectation keyed ``(region, phase)``, ``!`` where counts or bytes differ;
``print_same_as`` compares other runs with a reference; ``print_op_diff`` sets two runs' profiler op counts side by
side. A counter holds ``{kind: count, kind + "B": bytes of the full (unsharded) tensors}``.
"""

from __future__ import annotations

import re
from collections import Counter, defaultdict
from typing import Any

import torch

from benchmarks.report import MB

KB = 2**10
KINDS = ("AR", "AG", "RS", "A2A", "BC")
_KIND_OF = (
    ("all_reduce", "AR"),
    ("allreduce", "AR"),
    ("all_gather", "AG"),
    ("allgather", "AG"),
    ("reduce_scatter", "RS"),
    ("all_to_all", "A2A"),
    ("alltoall", "A2A"),
    ("broadcast", "BC"),
)
_PHASES = {"forward": "fwd", "backward": "bwd", "optimizer": "opt"}
Regions = dict[tuple[str, str], Counter]


def comm_recorder(world: int) -> Any:
    """A ``CommDebugMode`` recording each collective (see the module docstring); ``.result``: the records."""
    from torch.distributed.distributed_c10d import GroupName, _resolve_process_group
    from torch.distributed.tensor.debug import CommDebugMode
    from torch.distributed.tensor.debug._comm_mode import c10d_collective_ops

    class CommRecorder(CommDebugMode):
        def __init__(self) -> None:
            super().__init__()
            self.result: list[dict[str, Any]] = []
            self._phase = "fwd"

        phase = property(lambda self: self._phase, lambda self, name: setattr(self, "_phase", _PHASES[name]))

        def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
            out = super().__torch_dispatch__(func, types, args, kwargs)
            if out is NotImplemented or isinstance(func, torch._ops.HigherOrderOperator):
                return out  # DTensor desugars first; the collectives it issues come back here as plain ops
            if func._overloadpacket in self.comm_registry or func._overloadpacket in c10d_collective_ops:
                self.result.append(self._describe(str(func), args))
            return out

        def _describe(self, name: str, args: tuple) -> dict[str, Any]:
            eager = not name.startswith(("_c10d_functional", "c10d_functional", "_dtensor"))
            group = None
            if eager:  # c10d ops: (tensors, ProcessGroup, ...)
                for arg in args[1:]:
                    try:
                        group = int(torch.distributed.ProcessGroup.unbox(arg).size())
                        break
                    except Exception:
                        continue
            else:  # functional collectives end with the group's name
                names = [arg for arg in args[1:] if isinstance(arg, str)]
                group = _resolve_process_group(GroupName(names[-1])).size() if names else None
            kind = next((k for pattern, k in _KIND_OF if pattern in name), name)
            nbytes = sum(t.numel() * t.element_size() for t in _tensors(args[0] if args else None))
            if kind == "AG" and not eager:
                nbytes *= group or world  # a functional all-gather's input is the local shard
            module = self.advanced_module_tracker.name
            return {
                "kind": kind,
                "eager": eager,
                "phase": self._phase,
                "bytes": nbytes,
                "group": group or world,
                "module": module.split(".", 1)[1] if "." in module else module,
            }

    return CommRecorder()


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    return [t for v in value for t in _tensors(v)] if isinstance(value, (list, tuple)) else []


def regions(records: list[dict[str, Any]], blocks: str | None) -> Regions:
    """``{(region, phase): counter}``; regions ``block <i>``, ``outside``, ``optimizer``, ``logging`` (eager c10d)."""
    pattern = re.compile(re.escape(blocks) + r"\.(\d+)(\.|$)") if blocks else None
    out: Regions = defaultdict(Counter)
    for r in records:
        match = pattern.search(r["module"]) if pattern else None
        if r["eager"]:
            key = ("logging", "")
            out[key]["group"] = r["group"]
        elif r["phase"] == "opt":
            key = ("optimizer", "opt")
        else:
            key = (f"block {match.group(1)}" if match else "outside", r["phase"])
        out[key][r["kind"]] += 1
        out[key][r["kind"] + "B"] += r["bytes"]
    return out


def total(counters: list[Counter]) -> Counter:
    out: Counter = Counter()
    for c in counters:
        out.update({k: v for k, v in c.items() if k != "group"})
    return out


def ring(c: Counter, world: int) -> float:
    """Bytes each rank sends with ring algorithms: all-reduce 2(w-1)/w, the others (w-1)/w of the full tensor."""
    f = (world - 1) / world
    return sum(c.get(k + "B", 0) * (2 * f if k == "AR" else f) for k in KINDS)


def fmt_bytes(n: float) -> str:
    return f"{n / MB:.2f} MB" if n >= MB else f"{n / KB:.1f} KB" if n >= KB else f"{n:.0f} B"


def fmt(c: Counter | None, world: int) -> str:
    if not c or not any(c.get(k) for k in KINDS):
        return "-"
    return (
        " + ".join(f"{c[k]} {k} {fmt_bytes(c[k + 'B'])}" for k in KINDS if c.get(k))
        + f"  (ring {fmt_bytes(ring(c, world))})"
    )


def _comparable(c: Counter | None) -> dict[str, float]:
    return {k: round(v) for k, v in (c or {}).items() if v and k != "group"}


def _blocks(regs: Regions) -> dict[int, dict[str, Counter]]:
    out: dict[int, dict[str, Counter]] = defaultdict(dict)
    for (region, phase), c in regs.items():
        if region.startswith("block "):
            out[int(region.split()[1])][phase] = c
    return out


def by_region(regs: Regions) -> Regions:
    """All blocks summed per phase, outside the blocks per phase, optimizer step; logging left out."""
    out: Regions = {k: c for k, c in regs.items() if k[0] in ("outside", "optimizer")}
    for phase in ("fwd", "bwd"):
        counters = [blk[phase] for blk in _blocks(regs).values() if phase in blk]
        if counters:
            out[("all blocks", phase)] = total(counters)
    return out


def print_against(regs: Regions, expected: Regions, layers: int, world: int, label: str = "analytic") -> Counter:
    """Measured per block, outside the blocks and in the optimizer step beside ``expected`` (keys ``("block",
    phase)`` for each block, ``("outside", phase)``, ``("optimizer", "opt")``), ``!`` where they differ; the total."""
    blocks = _blocks(regs)
    first = blocks[min(blocks)] if blocks else {}
    same = all(blk == first for blk in blocks.values())
    print(f"  {'region':<22} {'phase':<5} {'measured':<58} {label:<50}")
    rows = [
        (
            f"each block (x{len(blocks)})" if same else "block 0",
            phase,
            first.get(phase),
            expected.get(("block", phase)),
        )
        for phase in ("fwd", "bwd")
    ]
    rows += [
        ("outside the blocks", phase, regs.get(("outside", phase)), expected.get(("outside", phase)))
        for phase in ("fwd", "bwd")
    ]
    rows.append(("optimizer step", "", regs.get(("optimizer", "opt")), expected.get(("optimizer", "opt"))))
    measured = total([c for (region, _), c in regs.items() if region != "logging"])
    wanted = total(
        [c for (region, _), c in expected.items() if region != "block"]
        + [c for (region, _), c in expected.items() if region == "block"] * layers
    )
    rows.append(("total", "", measured, wanted))
    for region, phase, m, e in rows:
        flag = " " if _comparable(m) == _comparable(e) else "!"
        print(f"{flag} {region:<22} {phase:<5} {fmt(m, world):<58} {fmt(e, world):<50}")
    for i in sorted(blocks)[1:] if not same else []:
        if blocks[i] != first:
            print(f"    block {i} differs: " + "; ".join(f"{p} {fmt(c, world)}" for p, c in blocks[i].items()))
    log = regs.get(("logging", ""))
    if log:
        print(
            f"  + eager c10d (Lightning's self.log(sync_dist=True)): {log['AR']} AR of {fmt_bytes(log['ARB'])} over a"
            f" group of {log['group']}"
        )
    return measured


def print_same_as(reference: Regions, others: dict[str, Regions], world: int) -> list[str]:
    """Whether each other run issues the reference run's collectives (logging apart); returns those that differ."""
    ref, differ = by_region(reference), []
    for label, regs in others.items():
        mine, log = by_region(regs), regs.get(("logging", ""))
        log_s = f"; + {log['AR']} AR logging over a group of {log['group']}" if log else "; no logging collective"
        diff = [k for k in sorted(set(ref) | set(mine)) if _comparable(ref.get(k)) != _comparable(mine.get(k))]
        print(f"{'!' if diff else ' '} {label}: {'DIFFERENT' if diff else 'same'}{log_s}")
        for region, phase in diff:
            print(
                f"    {region} {phase}: {fmt(mine.get((region, phase)), world)}   reference:"
                f" {fmt(ref.get((region, phase)), world)}"
            )
        differ += [label] if diff else []
    return differ


def print_op_diff(
    a: dict[str, tuple[int, float]], b: dict[str, tuple[int, float]], labels: tuple[str, str], top: int = 25
) -> None:
    """Ops whose count differs between two profiled steps, by self CPU time of the first; then the totals."""
    print(f"  {'op':<52} {labels[0] + ' n':>8} {'ms':>7} {labels[1] + ' n':>8} {'ms':>7}")
    keys = sorted(set(a) | set(b), key=lambda k: -a.get(k, (0, 0.0))[1])
    differ = [k for k in keys if a.get(k, (0, 0.0))[0] != b.get(k, (0, 0.0))[0]]
    for k in differ[:top]:
        (na, ta), (nb, tb) = a.get(k, (0, 0.0)), b.get(k, (0, 0.0))
        print(f"  {k[:52]:<52} {na:8d} {ta:7.2f} {nb:8d} {tb:7.2f}")
    print(
        f"  ({len(keys) - len(differ)} ops with the same count in both; totals {labels[0]}"
        f" {sum(n for n, _ in a.values())} ops {sum(t for _, t in a.values()):.1f} ms self CPU, {labels[1]}"
        f" {sum(n for n, _ in b.values())} ops {sum(t for _, t in b.values()):.1f} ms)"
    )
