"""The pipeline timelines the docs draw, played from torch's own orders, agree with the planner's model: the bubble
(p-1)/(v m + p-1) is what GPipe, 1F1B and the looped schedules idle (the zero-bubble ones idle less: the planner is
conservative for them), and the activations the first rank holds at once are the planner's ``in_flight``."""

from __future__ import annotations

import pytest

from lightning_mgpu.options import ParallelOptions
from lightning_mgpu.parallel.pipeline import PIPELINE_SCHEDULES, bubble_fraction, timeline
from lightning_mgpu.planner.cost import in_flight
from lightning_mgpu.planner.job import Layout, Microbatching

SIZES = [(2, 4), (4, 8), (4, 16), (8, 16)]  # (pp, microbatches): counts every schedule runs
ZERO_BUBBLE = ("InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV")


@pytest.mark.parametrize("schedule", PIPELINE_SCHEDULES)
def test_the_timeline_gives_the_planners_bubble_and_activations(schedule):
    for pp, microbatches in SIZES:
        played = timeline(schedule, pp, microbatches)
        planned = bubble_fraction(pp, microbatches, played.stages_per_rank)
        if schedule in ZERO_BUBBLE:
            assert played.idle_fraction < planned, (pp, microbatches)
        else:
            assert played.idle_fraction == pytest.approx(planned, abs=1e-9), (pp, microbatches)
        options = ParallelOptions(pipeline_schedule=schedule, num_microbatches=microbatches)
        layout = Layout.of(pp=pp, options=options, microbatching=Microbatching(count=microbatches))
        assert played.peak_in_flight(0) == pytest.approx(in_flight(layout)), (pp, microbatches)
        assert max(played.peak_in_flight(rank) for rank in range(pp)) == pytest.approx(played.peak_in_flight(0))


def test_each_computation_runs_once_after_what_it_needs():
    played = timeline("ZBVZeroBubble", 4, 8)
    ends = {}
    for slot in sorted(played.slots, key=lambda s: s.start):
        for kind in slot.kind.split("+"):
            ends.setdefault((kind, slot.stage, slot.microbatch), slot.start + slot.duration)
    stages = 4 * played.stages_per_rank
    assert len(ends) == stages * 8 * 3  # a forward, an input gradient and a weight gradient per stage and microbatch
    for rank in range(4):
        mine = sorted((s for s in played.slots if s.rank == rank), key=lambda s: s.start)
        assert all(a.start + a.duration <= b.start + 1e-9 for a, b in zip(mine, mine[1:]))  # one at a time
