"""Parallelizers, applied to the LightningModule in a fixed order after ``configure_model``.

Each parallelism is a subpackage with the same two entry points: ``check(layout, options)``, run on every layout
before any process starts (``layout_checks``), and ``apply(...)``, which ``parallelize`` calls in torchtitan's
order (tensor, checkpointing, compilation, pipeline, experts, data; context parallelism patches the step's calls).
``parallelize`` returns the one :class:`ParallelRun` the strategy drives.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import nn
from torch.distributed.fsdp import CPUOffloadPolicy

from lightning_mgpu.layout import PP_AXIS, TP_AXIS, ParallelLayout, gradient_mesh, zero_mesh
from lightning_mgpu.options import ParallelOptions
from lightning_mgpu.parallel import context, data, experts, pipeline, tensor
from lightning_mgpu.parallel.activation import apply_activation_checkpointing
from lightning_mgpu.parallel.blocks import compile_blocks, is_float8_linear
from lightning_mgpu.parallel.data import replicates_parameters, sharded_by_user
from lightning_mgpu.parallel.example import ExampleStep
from lightning_mgpu.parallel.experts import (
    apply_global_router_loss,
    check_no_router_loss,
    find_expert_lists,
    plan_without_experts,
)
from lightning_mgpu.parallel.pipeline import PipelineEngine, PipelineRuntime
from lightning_mgpu.parallel.run import DataParallelEngine, ParallelRun, StepRunner

if TYPE_CHECKING:
    import torch
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import MixedPrecisionPolicy

    from lightning_mgpu.parallel.run import RunPrecision
    from lightning_mgpu.patches import PatchLog

__all__ = ["DataParallelEngine", "ParallelRun", "StepRunner", "parallelize"]


def parallelize(
    module: nn.Module,
    layout: ParallelLayout,
    mesh: DeviceMesh,
    options: ParallelOptions,
    precision: RunPrecision,
    device: torch.device,
    patches: PatchLog,
    data_parallel: DataParallelEngine,
    example: ExampleStep | None = None,
) -> ParallelRun:
    """Every parallelism of ``layout`` applied to ``module`` in place (tensor, checkpointing, compilation, pipeline,
    experts, data), and the run that drives it: the step runner Lightning calls, the pipeline engine that runs the
    schedule, the batch splitting and attention of context parallelism, and ``data_parallel``, the engine whose
    wraps (torch's, applied here) or engine (DeepSpeed's, built once the optimizers exist) make the data-parallel
    dimension. ``example`` runs the user's step on one batch, where ``tp_plan="auto"`` reads how the blocks are
    called. Patches on the user's objects go into ``patches``."""
    _refuse_manual_optimization_under_pipelining(module, layout)
    runner = StepRunner(module)
    torch_wraps = data_parallel.applies_torch_wraps
    stages = _apply(module, layout, mesh, options, precision.mp_policy(), runner, torch_wraps, example)
    run = ParallelRun(runner, data_parallel)
    if layout.context_parallel_size > 1:
        run.context = context.apply(module, mesh, options, patches)
    if stages is not None:
        pp_group = mesh[PP_AXIS].get_group()
        schedule, microbatches = options.pipeline_schedule, options.num_microbatches
        run.pipeline = PipelineEngine(module, stages, schedule, microbatches, pp_group, device)
        run.pipeline.share_with(precision)
        patches.add(run.pipeline.remove)
    return run


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


def _apply(
    module: nn.Module,
    layout: ParallelLayout,
    mesh: DeviceMesh,
    options: ParallelOptions,
    mp_policy: MixedPrecisionPolicy | None,
    root: nn.Module,
    torch_wraps: bool,
    example: ExampleStep | None,
) -> PipelineRuntime | None:
    """Each parallelism's ``apply`` in torchtitan's order; with pipeline parallelism, this rank's stages (each then
    a data-parallel root of its own; else ``root``, called once per step). ``torch_wraps``: the data-parallel
    engine's wraps are torch's, applied here (DeepSpeed's engine is its own wrap)."""
    # A configure_model that applied fully_shard itself (Lightning's ModelParallelStrategy style) keeps its own wrap;
    # asked first, before the experts' own fully_shard below.
    wrap = not sharded_by_user(module, layout.zero_stage, layout.pipeline_parallel_size)
    if layout.tensor_parallel_size > 1:
        if any(is_float8_linear(m) for m in module.modules()):
            raise NotImplementedError("fp8-mixed with tensor_parallel_size > 1 is not supported yet.")
        tp_plan = options.tp_plan
        if layout.expert_parallel_size > 1:
            # experts: split over ep
            tp_plan = plan_without_experts(module, tp_plan, options.sequence_parallel, example)
        tensor.apply(module, mesh[TP_AXIS], tp_plan, options.sequence_parallel, options.loss_parallel, example)
    if options.activation_checkpointing is not False:
        # Before the pipeline split: its gate around each owned block must stay *outside* the checkpointed region,
        # so that recomputation in backward sees the same (received) input as the forward did.
        apply_activation_checkpointing(module, options.activation_checkpointing)
    if options.compile is not False:
        # After tensor parallelism and checkpointing, before the pipeline's gates and the data-parallel wrap, whose
        # hooks stay outside the compiled region (torchtitan's order).
        compile_blocks(module, {} if options.compile is True else options.compile)
    runtime = None
    if layout.pipeline_parallel_size > 1:
        runtime = pipeline.apply(module, mesh, options)
    offload_policy = None
    if options.cpu_offload:
        # Pinned host memory makes the copies to and from the GPU asynchronous; there is none without CUDA.
        offload_policy = CPUOffloadPolicy(pin_memory=mesh.device_type == "cuda")
    # The wrap also does the casting (param_dtype) and the offloading, so it applies at dp=1 when either is asked.
    casts = mp_policy is not None and getattr(mp_policy, "param_dtype", None) is not None
    if layout.expert_parallel_size > 1:
        # Before the data-parallel wrap, which then leaves the experts (wrapped over their replicas) out.
        if runtime is not None:
            sizes = f"expert_parallel_size={layout.expert_parallel_size}, pipeline_parallel_size=" + str(
                layout.pipeline_parallel_size
            )
            check_no_router_loss(module, f"{sizes}: the last stage would compute it from its own layers' logits only")
        # Under pipelining at ZeRO 0/1 the schedule reduces the gradients of `replicate` wraps only.
        experts.apply(
            module,
            mesh,
            layout.expert_parallel_size,
            layout.zero_stage,
            mp_policy,
            offload_policy,
            replicate=runtime is not None and replicates_parameters(layout),
        )
    if layout.gradient_ranks > 1 and runtime is None:
        # A Hugging Face load-balancing loss on the whole batch, as one process computes it (not each rank's own).
        apply_global_router_loss(module, gradient_mesh(mesh).get_group())
    if torch_wraps and wrap and (layout.gradient_ranks > 1 or offload_policy is not None or casts):
        # With pipelining each stage is a root of its own: the schedule drives each stage's gradient sync
        # (no-sync on all but the last backward of a step), also when a rank holds several stages.
        roots = [(stage, stage.blocks) for stage in runtime.stages] if runtime is not None else [(root, None)]
        # Schedules with several stages per rank: ZeRO-3 blocks keep their parameters gathered from their first
        # forward in a step until the gradients are reduced (torchtitan's default with pipelining), so memory
        # within a step is ZeRO-2's; freeing blocks after each forward breaks looped schedules' backward in
        # torch 2.13.
        reshard_blocks = None if runtime is None or len(runtime.stages) == 1 else False
        # Routed experts in a ModuleList can get no token on a rank in any step: DDP keeps searching for them.
        find_unused = options.find_unused_parameters
        if find_unused is None and find_expert_lists(module):
            find_unused = True
        hybrid_mesh = zero_mesh(mesh) if layout.data_parallel_shard_size is not None else None
        for stage_root, blocks in roots:
            data.apply(
                module,
                gradient_mesh(mesh),  # dp, or dp x cp: ranks whose gradients average
                layout.zero_stage,
                mp_policy=mp_policy,
                offload_policy=offload_policy,
                root=stage_root,
                blocks=blocks,
                reshard_blocks=reshard_blocks,
                find_unused_parameters=find_unused,
                hybrid_mesh=hybrid_mesh if hybrid_mesh is not None and hybrid_mesh.ndim == 2 else None,
                manual_optimization=not getattr(module, "automatic_optimization", True),
            )
    return runtime
