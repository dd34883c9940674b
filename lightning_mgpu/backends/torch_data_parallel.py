"""``zero_backend="torch"``: the data-parallel dimension on torch's own wraps (DDP, FSDP2 ``fully_shard`` and
``replicate``), which ``parallel.parallelize`` applies, and ZeRO-1's optimizer-state sharding, wired here once the
optimizers exist. The :class:`~lightning_mgpu.parallel.run.DataParallelEngine` that DeepSpeed's runner also is."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING

from torch import Tensor, nn

from lightning_mgpu.layout import zero_shard_mesh
from lightning_mgpu.parallel.data import (
    OptimizerStateSharding,
    finish_backward,
    frees_after_forward,
    partitions_optimizer_states,
)
from lightning_mgpu.parallel.experts import expert_parameters
from lightning_mgpu.parallel.local_step import ShardLocalStep, fused_on_cpu, steps_on_shards

if TYPE_CHECKING:
    import lightning.pytorch as pl
    from lightning.pytorch.plugins.precision import Precision
    from torch.distributed import ProcessGroup
    from torch.distributed.device_mesh import DeviceMesh
    from torch.optim import Optimizer

    from lightning_mgpu.checkpoint.states import StateAccess
    from lightning_mgpu.layout import ParallelLayout
    from lightning_mgpu.parallel.run import RunPrecision
    from lightning_mgpu.patches import PatchLog


class TorchDataParallel:
    """Torch's data parallelism through one run: the wraps are already on the module, the steps are Lightning's."""

    applies_torch_wraps = True
    restores_by_snapshot = True

    def state_access(self) -> StateAccess | None:
        return None  # DTensors and plain tensors: the checkpointer's own state access

    def gathers_fp8_weights(self, layout: ParallelLayout) -> bool:
        return frees_after_forward(layout)

    def wrap(
        self,
        runner: nn.Module,
        optimizers: list[Optimizer],
        trainer: pl.Trainer,
        layout: ParallelLayout,
        precision: str,
        dp_group: ProcessGroup,
    ) -> nn.Module:
        return runner  # wrapped inside `parallelize` already

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
        """Elementwise optimizers stepped on their DTensors' local shards; states sharded over data parallelism
        where the ZeRO stage partitions them (stage 1: stages 2-3 shard them inside FSDP2)."""
        for optimizer in optimizers:
            if steps_on_shards(optimizer):
                patches.add(ShardLocalStep(optimizer).remove)
        if not partitions_optimizer_states(layout):
            return []
        local = expert_parameters(module)  # sharded over their own mesh: each rank steps its own
        shard_mesh = zero_shard_mesh(mesh)  # all of dp, or one hybrid-sharding group
        return [OptimizerStateSharding(optimizer, shard_mesh, roots, precision, local) for optimizer in optimizers]

    def backward(
        self,
        loss: Tensor,
        module: pl.LightningModule,
        precision: Precision,
        roots: list[nn.Module],
        default: Callable[[], Tensor],
    ) -> Tensor:
        loss = default()
        finish_backward(roots)  # DDP: parameters left without a gradient, before the step
        return loss

    def optimizer_step(
        self,
        optimizer: Optimizer,
        closure: Callable[[], object],
        module: pl.LightningModule,
        default: Callable[[], object],
    ) -> object:
        # Adam/AdamW on plain CPU tensors step with torch's fused kernel where the user chose neither foreach nor fused.
        with fused_on_cpu(optimizer):
            return default()

    def checkpoint_entries(self) -> dict[str, object]:
        return {}

    def load_checkpoint_entries(self, loaded: Mapping[str, object]) -> None:
        """Nothing beyond weights and optimizer states (a DeepSpeed checkpoint's engine entries are left unread)."""

    def release(self, module: nn.Module) -> None:
        """Nothing: the strategy gives the module back from its snapshot."""
