"""The rehearsal: ``lightning-mgpu plan --rehearse``, a large job's ranks played on this machine by the library's
own setup path, on meta tensors and torch's fake process group.

``run`` plays the ranks (the bytes each holds, beside the planner's prediction) and is the command's entry point,
``step`` one training step of a rank under a recording dispatch mode (the collectives of each mesh axis).

It sits above the strategy, beside the command line: it drives ``strategy.setup`` and ``strategy.step``. The planner
(``lightning_mgpu.planner``) is a lower layer that the strategy itself calls when the Trainer is built (``"auto"``
sizes: ``planner.auto``), so the planner never imports the strategy; the rehearsal, which does, lives here
(``tests/test_import_graph.py`` guards the direction).
"""

from lightning_mgpu.rehearsal.run import (
    Pretrained,
    RankReport,
    RehearsalError,
    beside_the_planner,
    format_rehearsal,
    positions,
    predicted_bytes,
    rehearse,
    rehearse_rank,
    run_rehearsal,
)
from lightning_mgpu.rehearsal.step import Collectives, StepBatch, count_step_collectives, describe_collectives

__all__ = [
    "Collectives",
    "Pretrained",
    "RankReport",
    "RehearsalError",
    "StepBatch",
    "beside_the_planner",
    "count_step_collectives",
    "describe_collectives",
    "format_rehearsal",
    "positions",
    "predicted_bytes",
    "rehearse",
    "rehearse_rank",
    "run_rehearsal",
]
