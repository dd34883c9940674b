"""The user's module made parallel for one run, and its optimizers wired to the result.

``HybridStrategy.setup`` calls these; every patch they make on the user's objects goes into the run's ``PatchLog``
and is undone at ``teardown``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.optim import Optimizer

from lightning_mgpu.layout import CP_AXIS, PP_AXIS, ParallelLayout, zero_shard_mesh
from lightning_mgpu.options import ParallelOptions
from lightning_mgpu.parallel import StepRunner, parallelize
from lightning_mgpu.parallel.context import ContextParallel
from lightning_mgpu.parallel.data import OptimizerStateSharding, stop_watching
from lightning_mgpu.parallel.example import ExampleStep
from lightning_mgpu.parallel.experts import expert_parameters
from lightning_mgpu.parallel.local_step import ShardLocalStep, steps_on_shards
from lightning_mgpu.parallel.pipeline import PipelineEngine
from lightning_mgpu.patches import PatchLog
from lightning_mgpu.precision import HybridPrecision

if TYPE_CHECKING:
    import torch
    from torch.distributed.device_mesh import DeviceMesh


def parallelize_for_run(
    module: nn.Module,
    layout: ParallelLayout,
    mesh: DeviceMesh,
    options: ParallelOptions,
    precision: HybridPrecision,
    device: torch.device,
    patches: PatchLog,
    example: ExampleStep | None = None,
) -> tuple[StepRunner, PipelineEngine | None, ContextParallel | None]:
    """Every parallelism of ``layout`` applied to ``module``; the step runner Lightning calls, the pipeline engine
    that runs the schedule when ``layout`` pipelines, and the batch splitting and attention of context
    parallelism. ``example`` (``example_step``) shows parallelizers how the user's step calls the model."""
    _refuse_manual_optimization_over_data_parallel(module, layout, options)
    runner = StepRunner(module)
    pipeline = parallelize(module, layout, mesh, options, precision.mp_policy(), runner, example)
    context = None
    if layout.context_parallel_size > 1:
        context = ContextParallel(module, mesh[CP_AXIS].get_group(), options.context_parallel_mode, patches)
    if pipeline is None:
        return runner, None, context
    engine = PipelineEngine(
        module, pipeline, options.pipeline_schedule, options.num_microbatches, mesh[PP_AXIS].get_group(), device
    )
    engine.share_with(precision)
    patches.add(engine.remove)
    return runner, engine, context


def example_step(trainer: Any, module: nn.Module, to_device: Callable[[Any], Any]) -> ExampleStep | None:
    """The user's training step on the first batch of the fit's training data, for the plans that read how the
    model is really called (``tp_plan="auto"``); the batch is fetched only if one asks. None outside ``fit``."""
    from lightning.pytorch.trainer.states import TrainerFn
    from lightning.pytorch.utilities import CombinedLoader

    from lightning_mgpu._compat.lightning import fit_data_source

    if trainer.state.fn != TrainerFn.FITTING:
        return None
    source = fit_data_source(trainer)
    if not source.is_defined():
        return None

    def first_batch() -> Any:
        batch, _, _ = next(iter(CombinedLoader(source.dataloader(), "max_size_cycle")))
        return to_device(batch)

    return ExampleStep(module, "training_step", first_batch)


def _refuse_manual_optimization_over_data_parallel(
    module: nn.Module, layout: ParallelLayout, options: ParallelOptions
) -> None:
    """Under manual optimization ``manual_backward`` runs inside ``training_step``, which is the data-parallel root's
    forward: DDP and FSDP2 prepare their gradient reduction only once that forward has returned (DDP fails, FSDP2
    reduces part of the gradients). Refused until the torch backend wraps such steps differently."""
    if getattr(module, "automatic_optimization", True) or options.zero_backend != "torch":
        return
    if layout.pipeline_parallel_size == 1 and (layout.gradient_ranks > 1 or options.cpu_offload):
        raise NotImplementedError(
            f"Manual optimization (`automatic_optimization = False`) with data_parallel_size="
            f"{layout.data_parallel_size}{' and cpu_offload=True' if options.cpu_offload else ''} is not supported:"
            " manual_backward runs inside training_step, before data parallelism can reduce its gradients. Use"
            " automatic optimization (return the loss from training_step), or data_parallel_size=1 (tensor"
            " parallelism supports manual optimization)."
        )


def unwire_optimizers(shardings: list[OptimizerStateSharding], watched_roots: Sequence[nn.Module] = ()) -> None:
    """Undo ZeRO-1's wrapping of the user's optimizers and, for ``watched_roots``, the hooks DDP roots may still hold
    on the user's parameters (``parallel/data/unused_params.py``, while the first step has not decided). Empties
    ``shardings``."""
    for sharding in shardings:
        sharding.remove()
    shardings.clear()
    for root in watched_roots:
        stop_watching(root)


def data_parallel_roots(pipeline: PipelineEngine | None, model: nn.Module | None) -> list[nn.Module]:
    """The modules the data-parallel root wraps went on: pipeline stages, or the step runner."""
    if pipeline is not None:
        return list(pipeline.runtime.stages)
    return [model] if model is not None else []


def reshard(roots: list[nn.Module]) -> None:
    """FSDP groups a step left unsharded (it raised between a forward's start and end) sharded again, so that the
    module holds the parameters the optimizer steps before the run hands them back. A no-op otherwise."""
    for root in roots:
        for sub in root.modules():
            if isinstance(sub, FSDPModule):
                # The root group keeps its parameters unsharded after forward: only ours, it is discarded next.
                sub.set_reshard_after_forward(True, recurse=False)
                sub.reshard()


def wire_optimizers(
    optimizers: Sequence[Optimizer],
    module: nn.Module,
    layout: ParallelLayout,
    mesh: DeviceMesh,
    pipeline: PipelineEngine | None,
    roots: list[nn.Module],
    precision: HybridPrecision,
    patches: PatchLog,
    deepspeed: Any | None,
) -> list[OptimizerStateSharding]:
    """The user's optimizers made to fit the run: ``zero_grad`` guarded under pipelining (the schedule made the
    gradients before Lightning zeroes them), elementwise ones stepped on their DTensors' local shards, states
    sharded over data parallelism at ZeRO stage 1."""
    if pipeline is not None:
        for optimizer in optimizers:
            patches.keep_attribute(optimizer, "zero_grad")
            pipeline.guard_zero_grad(optimizer)
    for optimizer in optimizers if deepspeed is None else ():
        if steps_on_shards(optimizer):
            patches.add(ShardLocalStep(optimizer).remove)
    if layout.zero_stage != 1 or layout.gradient_ranks == 1 or deepspeed is not None:
        return []
    local = expert_parameters(module)  # sharded over their own mesh: each rank steps its own
    shard_mesh = zero_shard_mesh(mesh)  # all of dp, or one hybrid-sharding group
    return [OptimizerStateSharding(optimizer, shard_mesh, roots, precision, local) for optimizer in optimizers]
