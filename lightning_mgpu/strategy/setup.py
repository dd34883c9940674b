"""The user's module made parallel for one run, and its optimizers wired to the result.

``HybridStrategy.setup`` calls these; every patch they make on the user's objects goes into the run's ``PatchLog``
and is undone at ``teardown``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.optim import Optimizer

from lightning_mgpu._compat.fsdp import init_fsdp_root, reshard_fsdp
from lightning_mgpu.layout import CP_AXIS, PP_AXIS, ParallelLayout, zero_shard_mesh
from lightning_mgpu.options import ParallelOptions
from lightning_mgpu.parallel import StepRunner, parallelize
from lightning_mgpu.parallel.context import ContextParallel
from lightning_mgpu.parallel.data import OptimizerStateSharding, partitions_optimizer_states, stop_watching
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
    _refuse_manual_optimization_under_pipelining(module, layout)
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


def _refuse_manual_optimization_under_pipelining(module: nn.Module, layout: ParallelLayout) -> None:
    """The schedule runs each microbatch's forward and backward itself, interleaved across stages: there is no
    place for the step's own ``manual_backward`` and ``optimizer.step()``."""
    if getattr(module, "automatic_optimization", True) or layout.pipeline_parallel_size == 1:
        return
    raise ValueError(
        f"pipeline_parallel_size={layout.pipeline_parallel_size} runs forward and backward inside the pipeline"
        " schedule (each microbatch's backward interleaved with other microbatches' forwards, on other stages), so"
        " it needs automatic optimization; this module sets `automatic_optimization = False` and calls"
        " `manual_backward` itself. Return the loss from training_step (automatic optimization), or use"
        " pipeline_parallel_size=1: data parallelism (ZeRO 0-3, HSDP) and tensor parallelism support manual"
        " optimization."
    )


@contextmanager
def optimizers_of_frozen_stages(module: nn.Module, pipeline: PipelineEngine | None) -> Iterator[None]:
    """Around the user's ``configure_optimizers``: a pipeline rank holding only frozen layers (a frozen backbone's
    first blocks) builds the optimizer over an empty parameter list, which torch refuses. Within, on such a rank, an
    empty list becomes one empty parameter group: an optimizer that steps nothing until a parameter group is added
    (``BackboneFinetuning`` adding the stage's unfrozen layers). Elsewhere nothing changes."""
    if pipeline is None or any(p.requires_grad for p in module.parameters()):
        yield
        return
    init = Optimizer.__init__

    def empty_stage_init(self: Optimizer, params: Any, defaults: dict[str, Any]) -> None:
        params = list(params)
        init(self, params or [{"params": []}], defaults)

    Optimizer.__init__ = empty_stage_init  # type: ignore[method-assign]
    try:
        yield
    finally:
        Optimizer.__init__ = init  # type: ignore[method-assign]


def unwire_optimizers(shardings: list[OptimizerStateSharding], watched_roots: Sequence[nn.Module] = ()) -> None:
    """Undo ZeRO-1's wrapping of the user's optimizers and, for ``watched_roots``, the hooks DDP roots may still hold
    on the user's parameters (``parallel/data/unused_params.py``, while the first step has not decided). Empties
    ``shardings``."""
    for sharding in reversed(shardings):  # each one restores what the one before it set
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
                # Mid-forward a group reshards only if set to: only ours, it is discarded next.
                sub.set_reshard_after_forward(True, recurse=False)
    shard_gathered(roots)


def name_fsdp_roots(roots: list[nn.Module]) -> None:
    """Each data-parallel root FSDP's root before anything runs: a submodule the user calls outside the step first
    (PPO's rollouts in its data loader, a callback sampling before training) would otherwise become a root of its
    own, and the step's forward be refused. Once the parameters hold their values."""
    for root in roots:
        init_fsdp_root(root)


def shard_gathered(roots: list[nn.Module]) -> None:
    """FSDP groups that keep their parameters gathered after a forward (the root's embeddings, norms and head; every
    group at ZeRO-2; FSDP2's replicate; a pipeline stage's last block, whose forward ends the stage by raising)
    sharded again, e.g. after ``trainer.validate``: a ``fit`` that reuses the parallel module then builds its
    optimizers on the sharded parameters, not on gathered copies that FSDP never reads or updates, and the module
    given back at teardown is the one the optimizers point at."""
    for root in roots:
        for sub in root.modules():
            reshard_fsdp(sub)


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
    if not partitions_optimizer_states(layout) or deepspeed is not None:
        return []
    local = expert_parameters(module)  # sharded over their own mesh: each rank steps its own
    shard_mesh = zero_shard_mesh(mesh)  # all of dp, or one hybrid-sharding group
    return [OptimizerStateSharding(optimizer, shard_mesh, roots, precision, local) for optimizer in optimizers]
