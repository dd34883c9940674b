"""A pipeline step's timeline, played from torch's own orders of the schedule's computations.

The looped and V schedules run the action lists torch builds for them (``_compat.pipelining.schedule_actions``);
GPipe and 1F1B run from code (``_step_microbatches``), whose order is written out here: GPipe every forward then
every backward; 1F1B ``pp - rank`` warm-up forwards (at most every microbatch), then one backward and one forward
in turn, then the remaining backwards (torch's action list for 1F1B numbers the last rank's forwards from 1, so it
is not used).

Each rank runs its actions in torch's order; an action starts once the rank is free and what it needs is done (a
stage's forward needs the previous stage's forward of that microbatch; its backward the next stage's backward and
its own forward; a weight gradient its input gradient). Times are in units of one rank's forward of one
microbatch: a stage's forward takes ``1 / stages_per_rank`` of it, a whole backward twice that, each half of a
split backward (input, weight gradients) as much as a forward. Communication takes no time. The docs draw their
schedule figures from it and the tests check the planner's bubble and activation-memory model against it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from lightning_mgpu._compat.pipelining import Computation, schedule_actions
from lightning_mgpu.parallel.pipeline.plan import SINGLE_STAGE_SCHEDULES
from lightning_mgpu.parallel.pipeline.plan import stages_per_rank as default_stages_per_rank

DURATIONS = {"F": 1.0, "B": 2.0, "I": 1.0, "W": 1.0}  # per stage, times stages_per_rank: one rank's forward = 1


@dataclass(frozen=True)
class Slot:
    """One computation on one rank: an overlapped forward-backward (DualPipeV) is one slot of kind ``"F+B"``."""

    rank: int
    start: float
    duration: float
    kind: str
    stage: int
    microbatch: int


@dataclass(frozen=True)
class Timeline:
    schedule: str
    pp_size: int
    microbatches: int
    stages_per_rank: int
    slots: tuple[Slot, ...]
    actions: tuple[tuple[Computation | list[Computation], ...], ...]  # each rank's actions as torch lists them

    @property
    def makespan(self) -> float:
        return max(slot.start + slot.duration for slot in self.slots)

    @property
    def idle_fraction(self) -> float:
        """The share of ranks x the step's time spent waiting (the bubble)."""
        busy = sum(slot.duration for slot in self.slots)
        return 1.0 - busy / (self.pp_size * self.makespan)

    def peak_in_flight(self, rank: int = 0) -> float:
        """The most microbatches' activations ``rank`` holds at once, in units of its layers (a stage's forward
        adds ``1 / stages_per_rank``, its backward, or input-gradient half, frees it)."""
        held = peak = 0.0
        for action in self.actions[rank]:
            for kind, _, _ in action if isinstance(action, list) else [action]:
                held += {"F": 1.0, "B": -1.0, "I": -1.0}.get(kind, 0.0) / self.stages_per_rank
                peak = max(peak, held)
        return peak


def timeline(schedule: str, pp_size: int, microbatches: int, stages_per_rank: int | None = None) -> Timeline:
    """Play ``schedule`` on ``pp_size`` ranks for ``microbatches`` microbatches (see the module docstring)."""
    per_rank = default_stages_per_rank(schedule, stages_per_rank)
    if schedule in SINGLE_STAGE_SCHEDULES:
        actions: Sequence[Sequence[Computation | list[Computation]]]
        actions = [_single_stage_order(schedule, rank, pp_size, microbatches) for rank in range(pp_size)]
    else:
        actions = schedule_actions(schedule, pp_size, microbatches, per_rank)
    last_stage = pp_size * per_rank - 1
    done: dict[tuple[str, int, int], float] = {}  # ("F" | "G": input gradient, stage, microbatch) -> end time
    free = [0.0] * pp_size
    position = [0] * pp_size
    slots: list[Slot] = []
    while any(position[r] < len(actions[r]) for r in range(pp_size)):
        progressed = False
        for rank in range(pp_size):
            if position[rank] == len(actions[rank]):
                continue
            action = actions[rank][position[rank]]
            parts = action if isinstance(action, list) else [action]
            needs = [need for part in parts for need in _needs(part, last_stage)]
            if any(need not in done for need in needs):
                continue
            start = max([free[rank], *(done[need] for need in needs)])
            duration = sum(DURATIONS[kind] for kind, _, _ in parts) / per_rank
            free[rank] = start + duration
            for kind, stage, microbatch in parts:
                done[("F" if kind == "F" else "G", stage, microbatch)] = free[rank]
            kind, stage, microbatch = parts[0]
            slots.append(Slot(rank, start, duration, "+".join(p[0] for p in parts), stage, microbatch))
            position[rank] += 1
            progressed = True
        if not progressed:
            raise RuntimeError(f"{schedule}'s actions wait on each other (pp={pp_size}, m={microbatches})")
    return Timeline(schedule, pp_size, microbatches, per_rank, tuple(slots), tuple(tuple(a) for a in actions))


def _single_stage_order(schedule: str, rank: int, pp_size: int, microbatches: int) -> list[Computation]:
    forwards = [("F", rank, m) for m in range(microbatches)]
    backwards = [("B", rank, m) for m in range(microbatches)]
    if schedule == "GPipe":
        return forwards + backwards
    warmup = min(microbatches, pp_size - rank)
    order = forwards[:warmup]
    for m in range(microbatches - warmup):
        order += [backwards[m], forwards[warmup + m]]
    return order + backwards[microbatches - warmup :]


def _needs(part: tuple[str, int, int], last_stage: int) -> list[tuple[str, int, int]]:
    kind, stage, microbatch = part
    if kind == "F":
        return [("F", stage - 1, microbatch)] if stage > 0 else []
    if kind == "W":
        return [("G", stage, microbatch)]
    after = [("G", stage + 1, microbatch)] if stage < last_stage else []
    return [("F", stage, microbatch), *after]
