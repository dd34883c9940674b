"""The layout a ``HybridStrategy`` runs: each candidate checked against the options when the Trainer is built
(``layout_checks``, which the planner runs on its candidates too), and, where ``"auto"`` sizes leave several, the
planner's choice at setup, agreed on by every rank."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn

from lightning_mgpu.layout import ParallelLayout, warn_about_layout
from lightning_mgpu.options import ParallelOptions
from lightning_mgpu.planner import auto as planner_auto
from lightning_mgpu.precision import HybridPrecision


def check_trainer_layout(
    layout: ParallelLayout | None,
    options: ParallelOptions,
    precision: HybridPrecision,
    sync_batchnorm: bool,
    num_processes: int,
    num_nodes: int,
) -> None:
    """What needs the resolved sizes and the Trainer's devices: raised in the launching process.

    ``None``: the planner chooses at setup among layouts that ``check_sizes`` already accepted.
    """
    if sync_batchnorm:
        raise NotImplementedError(
            "HybridStrategy does not implement Trainer(sync_batchnorm=True) yet: BatchNorm statistics would stay"
            " per rank. Remove sync_batchnorm=True (or use GroupNorm/LayerNorm, which need no synchronization)."
        )
    if layout is None:
        return
    # At dp=1 the data-parallel wrap still serves cpu_offload or a param_dtype cast.
    wrapped = options.cpu_offload or precision.param_dtype is not None
    warn_about_layout(layout, num_processes, num_nodes, wrapped)


def agreed_plan(
    module: Any,  # the strategy's lightning_module: typed Optional by Lightning, set by now
    choices: list[ParallelLayout],
    options: ParallelOptions,
    precision: str,
    devices: tuple[int, int, str],
    global_rank: int,
    broadcast: Callable[[Any, int], Any],
) -> planner_auto.StrategyPlan:
    """Global rank 0 asks the planner (module, ``devices``: world size, devices per node and their type, batch
    size, precision) and every rank runs its answer, so that ranks never disagree; an error there is raised on
    every rank rather than left to hang the others."""
    answer: Any = None
    failure: Exception | None = None
    if global_rank == 0:
        try:
            cluster, batch = planner_auto.local_cluster(*devices), planner_auto.batch_per_replica(module)
            answer = planner_auto.plan_strategy_layout(module, choices, cluster, batch, precision, options)
        except Exception as error:  # noqa: BLE001 - raised on every rank below
            failure = error
            answer = error if isinstance(error, ValueError) else RuntimeError(f"{type(error).__name__}: {error}")
    answer = broadcast(answer, 0)
    if isinstance(answer, Exception):
        raise failure or answer
    if answer.estimate is None:
        rank_zero_warn(answer.describe())
    else:
        rank_zero_info(answer.describe())
    return answer
