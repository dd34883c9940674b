"""What parallelizing a module makes for one run: the :class:`ParallelRun` the strategy's hooks read, and the
:class:`DataParallelEngine` protocol behind its data-parallel dimension.

``parallel.parallelize`` returns the run; the engine is torch's (``backends.torch_data_parallel``: DDP, FSDP2 and
ZeRO-1's optimizer sharding) or DeepSpeed's (``backends.deepspeed``), chosen by ``zero_backend`` when the strategy is
built. Each hook asks the run, or the engine, instead of testing which parallelisms a run happens to have.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from lightning.pytorch.plugins.precision import Precision
from torch import Tensor, nn
from typing_extensions import override

from lightning_mgpu.parallel.data import OptimizerStateSharding, set_gradient_sync, stop_watching
from lightning_mgpu.parallel.pipeline import PipelinePrecision

if TYPE_CHECKING:
    import lightning.pytorch as pl
    from torch.distributed import ProcessGroup
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import MixedPrecisionPolicy
    from torch.optim import Optimizer

    from lightning_mgpu.layout import ParallelLayout
    from lightning_mgpu.parallel.context import ContextParallel
    from lightning_mgpu.parallel.pipeline import PipelineEngine
    from lightning_mgpu.patches import PatchLog


class StepRunner(nn.Module):
    """Calls one LightningModule step per ``__call__``: the data-parallel root that the strategy runs each step.

    Keeping the root outside the LightningModule means the user's own ``self(x)`` inside a step is a plain call
    and keys of ``lightning_module.state_dict()`` stay the user's.
    """

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module

    @override
    def forward(self, method_name: str, *args: object, **kwargs: object) -> object:
        return getattr(self.module, method_name)(*args, **kwargs)


class RunPrecision(PipelinePrecision, Protocol):
    """What a run reads of the precision plugin (``HybridPrecision``): the data-parallel wrap's FSDP2 policy, and
    what the pipeline engine shares with it (``PipelineEngine.share_with``)."""

    def mp_policy(self) -> MixedPrecisionPolicy | None: ...


class DataParallelEngine(Protocol):
    """The engine of the data-parallel dimension, as the strategy drives it through one run.

    ``default`` arguments are Lightning's own backward or optimizer step, which an engine runs or replaces.
    """

    applies_torch_wraps: bool
    """``True``: ``parallelize`` wraps the module with torch's DDP/FSDP2 for the ZeRO stage; ``False``: the engine
    is the wrap (built in :meth:`wrap`, once the optimizers exist)."""

    restores_by_snapshot: bool
    """``True``: the strategy gives the user's module back from its snapshot (``restore_plain``); ``False``: the
    engine gives it back in place (:meth:`release`)."""

    def gathers_fp8_weights(self, layout: ParallelLayout) -> bool:
        """Whether fp8 training all-gathers weights in fp8 (FSDP2 frees each unit's weights after its forward)."""
        ...

    def wrap(
        self,
        runner: nn.Module,
        optimizers: list[Optimizer],
        trainer: pl.Trainer,
        layout: ParallelLayout,
        precision: str,
        dp_group: ProcessGroup,
    ) -> nn.Module:
        """What each step calls, once the optimizers exist: ``runner``, or an engine around it."""
        ...

    def wire_optimizers(
        self,
        optimizers: Sequence[Optimizer],
        module: nn.Module,
        layout: ParallelLayout,
        mesh: DeviceMesh,
        roots: list[nn.Module],
        precision: RunPrecision,
        patches: PatchLog,
    ) -> list[OptimizerStateSharding]:
        """The user's optimizers made to step this engine's parameters; the optimizer-state shardings made."""
        ...

    def backward(
        self,
        loss: Tensor,
        module: pl.LightningModule,
        precision: Precision,
        roots: list[nn.Module],
        default: Callable[[], Tensor],
    ) -> Tensor: ...

    def optimizer_step(
        self,
        optimizer: Optimizer,
        closure: Callable[[], object],
        module: pl.LightningModule,
        default: Callable[[], object],
    ) -> object: ...

    def checkpoint_entries(self) -> dict[str, object]:
        """What a checkpoint keeps of the engine beside weights and optimizer states (``{}``: nothing)."""
        ...

    def load_checkpoint_entries(self, loaded: Mapping[str, object]) -> None: ...

    def release(self, module: nn.Module) -> None:
        """Give ``module`` back as plain torch objects, where ``restores_by_snapshot`` is ``False``. Collective."""
        ...


@dataclass(eq=False)
class ParallelRun:
    """One run's parallel module: the step runner, the pipeline engine (pipeline parallelism), the context-parallel
    runtime (context parallelism), the data-parallel engine and the optimizer-state shardings it made."""

    runner: StepRunner
    data_parallel: DataParallelEngine
    pipeline: PipelineEngine | None = None
    context: ContextParallel | None = None
    optimizer_sharding: list[OptimizerStateSharding] = field(default_factory=list)

    @property
    def roots(self) -> list[nn.Module]:
        """The modules the data-parallel root wraps went on: this rank's pipeline stages, or the step runner."""
        return list(self.pipeline.runtime.stages) if self.pipeline is not None else [self.runner]

    def wrap(
        self,
        optimizers: list[Optimizer],
        trainer: pl.Trainer,
        layout: ParallelLayout,
        precision: str,
        group: ProcessGroup,
    ) -> nn.Module:
        """What each step calls, once the optimizers exist: the step runner, or the engine wrapped around it."""
        return self.data_parallel.wrap(self.runner, optimizers, trainer, layout, precision, group)

    def wire_optimizers(
        self,
        optimizers: Sequence[Optimizer],
        module: nn.Module,
        layout: ParallelLayout,
        mesh: DeviceMesh,
        precision: RunPrecision,
        patches: PatchLog,
    ) -> None:
        """The user's optimizers made to fit the run: ``zero_grad`` guarded under pipelining (the schedule made the
        gradients before Lightning zeroes them), then the data-parallel engine's wiring (states sharded at ZeRO-1)."""
        if self.pipeline is not None:
            for optimizer in optimizers:
                patches.keep_attribute(optimizer, "zero_grad")
                self.pipeline.guard_zero_grad(optimizer)
        wire = self.data_parallel.wire_optimizers
        self.optimizer_sharding = wire(optimizers, module, layout, mesh, self.roots, precision, patches)

    def unwire_optimizers(self, stop_watching_roots: bool = False) -> None:
        """Undo ZeRO-1's wrapping of the user's optimizers and, with ``stop_watching_roots``, the hooks DDP roots
        may still hold on the user's parameters (``parallel/data/unused_params.py``, while the first step has not
        decided)."""
        for sharding in reversed(self.optimizer_sharding):  # each one restores what the one before it set
            sharding.remove()
        self.optimizer_sharding = []
        for root in self.roots if stop_watching_roots else ():
            stop_watching(root)

    def backward(
        self, loss: Tensor, module: pl.LightningModule, precision: Precision, default: Callable[[], Tensor]
    ) -> Tensor:
        """The step's backward: already run by the pipeline schedule inside the step (callbacks still get
        ``on_after_backward``), else the data-parallel engine's."""
        if self.pipeline is not None:
            return Precision.post_backward(precision, loss, module)
        return self.data_parallel.backward(loss, module, precision, self.roots, default)

    def set_gradient_sync(self, enabled: bool) -> None:
        """Gradient communication on or off (accumulation's non-final micro-steps), in every root and the schedule."""
        for root in self.roots:
            set_gradient_sync(root, enabled)
        if self.pipeline is not None:
            self.pipeline.sync_gradients = enabled
