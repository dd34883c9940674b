"""The pipeline options checked before any process starts: the schedule's name, its stages per rank, and a
microbatch count it can run (torch 2.13's schedules' own rules, named with the fix)."""

from __future__ import annotations

from lightning_mgpu.layout import ParallelLayout
from lightning_mgpu.options import ParallelOptions
from lightning_mgpu.parallel.pipeline.microbatches import microbatch_count_error
from lightning_mgpu.parallel.pipeline.plan import (
    LOOP_SCHEDULES,
    PIPELINE_SCHEDULES,
    SINGLE_STAGE_SCHEDULES,
    V_SCHEDULES,
    stages_per_rank,
)


def check(layout: ParallelLayout, options: ParallelOptions) -> None:
    """The options against one layout: a schedule torch runs, and a microbatch count it runs with ``pp`` ranks."""
    check_options(options)
    check_microbatches(options, layout.pipeline_parallel_size)


def check_options(options: ParallelOptions) -> None:
    """The schedule is one torch runs, with a number of stages per rank it places."""
    schedule, per_rank = options.pipeline_schedule, options.stages_per_rank
    if schedule not in PIPELINE_SCHEDULES:
        raise ValueError(
            f"`pipeline_schedule` must be one of {', '.join(map(repr, PIPELINE_SCHEDULES))}, got {schedule!r}."
        )
    if schedule in SINGLE_STAGE_SCHEDULES and per_rank not in (None, 1):
        raise ValueError(
            f"`stages_per_rank={per_rank}` needs a multi-stage schedule, but pipeline_schedule={schedule!r} runs"
            f" one stage per rank. Choose one of {', '.join(map(repr, LOOP_SCHEDULES))} (2 or more stages per"
            f" rank) or {', '.join(map(repr, V_SCHEDULES))} (two), or remove stages_per_rank."
        )
    if schedule in LOOP_SCHEDULES and per_rank == 1:
        raise ValueError(
            f"pipeline_schedule={schedule!r} loops over several stages per rank and needs stages_per_rank >= 2,"
            f" got `stages_per_rank=1`. Choose 'GPipe' or '1F1B' for one stage per rank, or remove stages_per_rank"
            " (default 2)."
        )
    if schedule in V_SCHEDULES and per_rank not in (None, 2):
        peers = SINGLE_STAGE_SCHEDULES if per_rank == 1 else LOOP_SCHEDULES
        raise ValueError(
            f"pipeline_schedule={schedule!r} places exactly two stages on each rank (a V), got"
            f" `stages_per_rank={per_rank}`. Remove stages_per_rank (or set it to 2), or choose one of"
            f" {', '.join(map(repr, peers))} for {per_rank} stage(s) per rank."
        )


def check_microbatches(options: ParallelOptions, pp_size: int) -> None:
    """A ``num_microbatches`` the schedule can never run, whatever the batch size, is refused up front."""
    if options.num_microbatches is None or pp_size <= 1:
        return
    schedule = options.pipeline_schedule
    num_stages = pp_size * stages_per_rank(schedule, options.stages_per_rank)
    why = microbatch_count_error(schedule, options.num_microbatches, pp_size, num_stages)
    if why is not None:
        raise ValueError(
            f"`num_microbatches={options.num_microbatches}` cannot run with pipeline_parallel_size={pp_size}: {why}."
            f" Set num_microbatches={num_stages} (one per stage, the default when it is not given) or another"
            f" count the schedule runs, or choose another pipeline_schedule."
        )
