"""The planner asked from code: the best layout for a real module on the devices at hand, for ``"auto"`` sizes.

``choose_layout``: the planner's best layout for a module at a given global batch, the sizes the user fixed kept.
``HybridStrategy`` with ``"auto"`` sizes or ZeRO stage uses the second half of this module: ``layout_candidates``
and ``valid_layouts`` (when the ``Trainer`` is built: the layouts its options run with), ``plan_strategy_layout``
(at setup, with the real module, devices and batch size: the fastest that fits, each at the global batch it really
runs) and ``StepClock`` (the measured step time logged beside the prediction at the end of ``fit``).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from torch import nn

from lightning_mgpu.gpus import gpu_named
from lightning_mgpu.layout import ParallelLayout, Size, degree_splits
from lightning_mgpu.options import ParallelOptions
from lightning_mgpu.planner.cluster import GB, ClusterSpec, Efficiency, preset
from lightning_mgpu.planner.cost import Estimate, estimate
from lightning_mgpu.planner.job import PRECISIONS, Layout, Training, microbatching_for
from lightning_mgpu.planner.model_spec import spec_from_module
from lightning_mgpu.planner.search import _structural_problem, explain, search

if TYPE_CHECKING:
    import lightning.pytorch as pl

log = logging.getLogger(__name__)


def local_cluster(world_size: int, devices_per_node: int, accelerator: str = "cpu") -> ClusterSpec:
    """This job's devices as a :class:`ClusterSpec`: a known GPU's preset with its real memory, or CPU processes
    sharing the machine's memory and cores (placeholder rates: :func:`plan_strategy_layout` measures them)."""
    if accelerator in ("cuda", "gpu"):
        import torch

        props = torch.cuda.get_device_properties(0)
        known = gpu_named(props.name)
        key = known.preset if known is not None else "h100-sxm"
        return preset(key, gpus=world_size, gpus_per_node=devices_per_node, memory_gb=props.total_memory / GB)
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GB
    except (ValueError, OSError):
        total = 16.0
    return ClusterSpec(
        gpus=world_size,
        gpus_per_node=devices_per_node,
        memory_gb=total / devices_per_node,
        peak_tflops=0.02,
        intra_node_gbps=1.0,
        inter_node_gbps=0.1,
        hbm_gbps=10.0,
        reserved_gb=0.0,
        name="cpu",
        cores_per_node=float(_cores()),
    )


def measured_cpu(cluster: ClusterSpec, module: nn.Module) -> tuple[ClusterSpec, Efficiency]:
    """CPU processes with this machine's rates for ``module``: ``calibrate.quick_measure`` (in this process, on a
    copy of the module, about a second, cached per model shape) with its documented gloo and DTensor rates."""
    from lightning_mgpu.planner.calibrate import quick_measure

    machine = quick_measure(spec_from_module(module), module)
    measured, efficiency = machine.as_cluster(cluster.gpus_per_node)
    return replace(measured, gpus=cluster.gpus, memory_gb=cluster.memory_gb), efficiency


def choose_layout(
    module: nn.Module,
    cluster: ClusterSpec,
    global_batch: int,
    precision: str = "bf16-mixed",
    fixed: dict[str, object] | None = None,
    seq_len: int | None = None,
    efficiency: Efficiency | None = None,
) -> Estimate:
    """The fastest layout that fits, keeping the ``fixed`` choices as :func:`~lightning_mgpu.planner.parse_fix` gives
    them: sizes by mesh axis (``tp``, ``pp``, ``dp``, ``cp``, ``ep``, ``dp_shard``), ``zero_stage``,
    ``microbatch_size``, and options by the strategy's names and values (``pipeline_schedule``,
    ``activation_checkpointing``, ``sequence_parallel``, ``context_parallel_mode``).

    Raises ``ValueError`` naming what does not fit when no layout does.
    """
    spec = spec_from_module(module, seq_len=seq_len)
    plan = search(spec, cluster, Training(global_batch=global_batch, precision=precision), efficiency, fixed)
    if plan.best is None:
        raise ValueError(f"The planner found no layout for {spec.describe()} on {cluster.describe()}: " + explain(plan))
    log.info("planner: %s", explain(plan))
    return plan.best


# ------------------------------------------------------------------ HybridStrategy's "auto" sizes and ZeRO stage
@dataclass
class StrategyPlan:
    """What ``HybridStrategy`` runs for its ``"auto"`` choices and why: the prediction (``None`` when the planner could
    not read the module, ``reason`` says why), and the steps measured while it trains."""

    layout: ParallelLayout
    estimate: Estimate | None = None
    reason: str = ""
    batch_per_replica: int = 1
    step_clock: StepClock = field(default_factory=lambda: StepClock())

    @property
    def predicted_step_s(self) -> float | None:
        return None if self.estimate is None else self.estimate.time["step"]

    def describe(self) -> str:
        if self.estimate is None:
            return (
                f"HybridStrategy: the 'auto' choices fall back to {self.layout.describe()} because {self.reason}."
                " Give tensor_parallel_size, pipeline_parallel_size and zero_stage explicitly to choose another."
            )
        mem, step = self.estimate.memory["total"], self.estimate.time["step"]
        return (
            f"HybridStrategy planned {self.layout.describe()}: predicted {mem / GB:.3g} GB per rank and"
            f" {step:.4g} s per step ({self.estimate.tokens_per_s:,.0f} tokens/s) at {self.batch_per_replica}"
            f" sequence(s) per data-parallel rank. {self.reason}"
        )

    def measured_beside_predicted(self) -> str | None:
        """The measured mean step time beside the prediction, once steps were timed."""
        measured, predicted = self.step_clock.mean(), self.predicted_step_s
        if measured is None or predicted is None:
            return None
        return (
            f"HybridStrategy {self.layout.describe()}: measured {measured:.4g} s per step, the planner predicted"
            f" {predicted:.4g} s (measured/predicted {measured / predicted:.2f})."
        )


def layout_candidates(
    world_size: int,
    data_parallel_size: Size,
    tensor_parallel_size: Size,
    pipeline_parallel_size: Size,
    zero_stage: Size,
    context_parallel_size: int = 1,
    expert_parallel_size: int = 1,
    data_parallel_shard_size: int | None = None,
) -> list[ParallelLayout]:
    """Every layout the requested sizes allow on ``world_size`` processes; the old rule's (``"auto"`` sizes 1, dp
    taking the rest, ZeRO 0) first, so that it is what a module the planner cannot read falls back to. Expert
    parallelism and HSDP's shard size are kept as given in each (``layout_checks`` drops those they do not fit).

    Sharded parameters under a pipeline (ZeRO >= 2 with pp > 1) are offered only when the stage is given, as the
    planner's search does; at dp=1 ZeRO has nothing to shard and ``"auto"`` means 0.
    """
    cp, ep, shard = context_parallel_size, expert_parallel_size, data_parallel_shard_size
    first = ParallelLayout.resolve(
        world_size, data_parallel_size, tensor_parallel_size, pipeline_parallel_size, zero_stage, cp, ep, shard
    )
    requested = {"dp": data_parallel_size, "tp": tensor_parallel_size, "pp": pipeline_parallel_size}
    found = [first]
    for dp, tp, pp in degree_splits(world_size, cp):
        if any(value != "auto" and value != size for value, size in zip(requested.values(), (dp, tp, pp))):
            continue
        fixed = (0 if zero_stage == "auto" else zero_stage,)
        stages = (0, 1, 2, 3) if zero_stage == "auto" and dp * cp > 1 else fixed
        for zero in stages:
            if zero >= 2 and pp > 1 and zero_stage == "auto":
                continue
            layout = ParallelLayout(dp, tp, pp, zero, cp, ep, shard)
            if layout not in found:
                found.append(layout)
    return found


def valid_layouts(candidates: list[ParallelLayout], check: Callable[[ParallelLayout], None]) -> list[ParallelLayout]:
    """The candidates ``check`` accepts (it raises on a layout the options cannot run with); when none is, raise the
    only candidate's own error, or one naming each candidate's reason."""
    valid, reasons = [], {}
    for layout in candidates:
        try:
            check(layout)
        except (ValueError, NotImplementedError) as error:
            if len(candidates) == 1:
                raise
            reasons[layout.describe()] = str(error)
        else:
            valid.append(layout)
    if valid:
        return valid
    if len(set(reasons.values())) == 1:
        raise ValueError(next(iter(reasons.values())))
    listed = "".join(f"\n- {layout}: {why}" for layout, why in reasons.items())
    raise ValueError(
        f"No layout the 'auto' sizes allow on {candidates[0].world_size} processes runs with these options:{listed}"
    )


def plan_strategy_layout(
    module: nn.Module,
    candidates: list[ParallelLayout],
    cluster: ClusterSpec,
    batch_per_replica: int | None,
    precision: str,
    options: ParallelOptions,
    efficiency: Efficiency | None = None,
) -> StrategyPlan:
    """The candidate (already checked against the strategy's options) that the cost model predicts fastest among
    those that fit, each at the global batch it will really run (``batch_per_replica x dp``: Lightning's batch size
    is per data-parallel rank), estimated as the strategy runs it: the whole layout (HSDP's shard groups too) with
    the strategy's options, cut into the microbatches they imply (``microbatching_for``). CPU processes
    (``cluster.cores_per_node`` set) without an ``efficiency`` are measured first (:func:`measured_cpu`).

    A module the planner cannot read falls back to the first candidate, saying why. Raises ``ValueError`` when none
    fits, naming what does not.
    """
    try:
        spec = spec_from_module(module)
    except ValueError as error:
        return StrategyPlan(candidates[0], reason=str(error))
    if precision not in PRECISIONS:
        return StrategyPlan(candidates[0], reason=f"the cost model has no precision {precision!r}")
    per_replica = batch_per_replica or 1
    if efficiency is None and cluster.cores_per_node is not None:
        cluster, efficiency = measured_cpu(cluster, module)
    efficiency = efficiency or Efficiency()
    fitting, problems = [], []
    for candidate in candidates:
        training = Training(global_batch=per_replica * candidate.dp, precision=precision)
        sizes = (candidate.tp, candidate.pp, candidate.dp, candidate.cp, candidate.ep)
        problem = _structural_problem(spec, cluster, training, *sizes)
        if problem:
            problems.append(f"{candidate.describe()}: {problem}")
            continue
        microbatching = microbatching_for(candidate, options, training.global_batch)
        layout = Layout.from_strategy(candidate, options, microbatching)
        result = estimate(spec, cluster, training, layout, efficiency)
        if result.fits:
            fitting.append((candidate, result))
        else:
            problems.append(f"{candidate.describe()} {result.problems[0]}")
    if not fitting:
        raise ValueError(
            f"The planner found no layout for {spec.describe()} on {cluster.describe()} that runs:"
            f" {'; '.join(problems)}. Give tensor_parallel_size/pipeline_parallel_size/zero_stage"
            " explicitly, or use more devices."
        )
    fitting.sort(key=lambda pair: (-pair[1].tokens_per_s, pair[1].memory["total"]))  # stable: old rule wins ties
    (best, result), rest = fitting[0], fitting[1:]
    why = f"Chosen for {spec.describe()} on {cluster.describe()}"
    if rest:
        runner, runner_result = rest[0]
        why += (
            f"; next best {runner.describe()} is predicted"
            f" {1 - runner_result.tokens_per_s / result.tokens_per_s:.0%} slower"
        )
    note = "" if batch_per_replica else " (batch size unknown: planned for 1 per rank)"
    return StrategyPlan(best, result, why + note + ".", per_replica)


def batch_per_replica(module: pl.LightningModule) -> int | None:
    """The per-rank batch size the fit will use, where it can be read without running user code: the DataLoader
    given to ``fit``, or a ``batch_size`` on the module, its hparams or its datamodule (as Lightning's tuner reads
    it). ``None`` when unknown."""
    from lightning.pytorch.utilities.parsing import lightning_getattr, lightning_hasattr

    from lightning_mgpu._compat.lightning import attached_trainer, fit_data_source

    trainer = attached_trainer(module)
    source = getattr(fit_data_source(trainer), "instance", None) if trainer is not None else None
    size = getattr(source, "batch_size", None)
    if _positive(size):
        return size
    try:
        size = lightning_getattr(module, "batch_size") if lightning_hasattr(module, "batch_size") else None
    except (AttributeError, RuntimeError):
        size = None
    return size if _positive(size) else None


class StepClock:
    """Mean wall time between training batches: what the prediction is compared with at the end of fit. The first
    interval (warm-up: allocations, first collectives) is left out when there are others."""

    def __init__(self) -> None:
        self.starts: list[float] = []

    def tick(self) -> None:
        self.starts.append(time.perf_counter())

    def mean(self) -> float | None:
        starts = self.starts[1:] if len(self.starts) > 2 else self.starts
        if len(starts) < 2:
            return None
        return (starts[-1] - starts[0]) / (len(starts) - 1)


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def _positive(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0
