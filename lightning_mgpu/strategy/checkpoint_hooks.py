"""Lightning's checkpoint hooks for ``HybridStrategy``: every state goes through ``checkpoint.Checkpointer``.

Lightning's own model and optimizer state hooks are empty: the checkpointer saves and loads the sharded states
under the plain module's FQNs, whatever the layout (see ``checkpoint/``).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from lightning.pytorch.strategies.parallel import ParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from torch import Tensor
from typing_extensions import override

from lightning_mgpu import checkpoint as sharded_checkpoint
from lightning_mgpu._compat.lightning import PATH, attached_trainer
from lightning_mgpu.checkpoint.export import shard_bytes
from lightning_mgpu.checkpoint.format import LiveModelState
from lightning_mgpu.launch import StartupBound, startup
from lightning_mgpu.layout import PP_AXIS, ParallelLayout

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from lightning_mgpu.backends import ZeroBackend
    from lightning_mgpu.parallel import ParallelRun


class CheckpointHooks(ParallelStrategy):
    """Mixed into ``HybridStrategy``, which sets the checkpointer, the data-parallel engine and the run."""

    _checkpointer: sharded_checkpoint.Checkpointer
    _data_parallel: ZeroBackend
    _run: ParallelRun | None
    _startup: StartupBound | None  # the run's start, until its first loop: a load at resume is part of it

    if TYPE_CHECKING:

        @property
        def layout(self) -> ParallelLayout: ...

        @property
        def device_mesh(self) -> DeviceMesh: ...

    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:  # the checkpointer loads into the sharded module
        return True

    @property
    @override
    def lightning_restore_optimizer(self) -> bool:
        return False

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        return LiveModelState()  # the states go through `checkpoint.Checkpointer.save`, wherever hooks move this

    @override
    def load_model_state_dict(self, checkpoint: Any, strict: bool = True) -> None:
        """Done in ``load_checkpoint``."""

    @override
    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        return {}

    @override
    def load_optimizer_state_dict(self, checkpoint: Any) -> None:
        """Done in ``load_checkpoint``."""

    @property
    def checkpointer(self) -> sharded_checkpoint.Checkpointer:
        """Saves and loads checkpoints (``checkpoint_format``, ``async_checkpoint``) for this strategy."""
        return self._checkpointer

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: PATH, storage_options: Any | None = None) -> None:
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__}.save_checkpoint does not take `storage_options`.")
        assert self.lightning_module is not None
        checkpoint = {**checkpoint, **self._data_parallel.checkpoint_entries()}  # DeepSpeed's loss scaler, counters
        self.checkpointer.save(checkpoint, filepath, self.lightning_module, list(self.optimizers), self.layout)

    @override
    def load_checkpoint(self, checkpoint_path: PATH, weights_only: bool | None = None) -> dict[str, Any]:
        module = self.lightning_module
        assert module is not None
        fitting = attached_trainer(module) is None or module.trainer.state.fn == TrainerFn.FITTING
        with startup.phase(self._startup, startup.CHECKPOINT_LOAD, then=startup.RESTORE):
            loaded = self.checkpointer.load(
                checkpoint_path,
                module,
                list(self.optimizers),
                strict=module.strict_loading,
                weights_only=weights_only,
                fitting=fitting,
            )
        if fitting:
            self._data_parallel.load_checkpoint_entries(loaded)
        return loaded

    @override
    def remove_checkpoint(self, filepath: PATH) -> None:
        self.checkpointer.remove(filepath)

    @override
    def process_dataloader(self, dataloader: object) -> object:
        # After a mid-epoch resume the training data continues where the checkpoint stopped (Lightning alone
        # would restart the epoch's batches); see `checkpoint.resume`.
        assert self.lightning_module is not None
        trainer = self.lightning_module.trainer
        return self.checkpointer.process_dataloader(dataloader, trainer, self.layout.data_parallel_size)

    def full_state_dict(self) -> dict[str, Tensor]:
        """The unsharded model weights on CPU on global rank 0 (``{}`` elsewhere). Call on every rank."""
        assert self.lightning_module is not None
        if self._data_parallel.state_access() is not None:  # an engine's own partitions (DeepSpeed)
            return self.checkpointer.states.full_model_state_dict(self.lightning_module)
        pipelined = self._run is not None and self._run.pipeline is not None
        pp_group = self.device_mesh[PP_AXIS].get_group() if pipelined else None
        return sharded_checkpoint.full_model_state_dict(self.lightning_module, pp_group)

    def save_hf_checkpoint(self, path: PATH, max_shard_size: int | str = "5GB") -> Path:
        """Write the model as a Hugging Face checkpoint under ``path``: safetensors shards of at most
        ``max_shard_size`` (bytes, or ``"500MB"``, ``"5GB"``), their ``model.safetensors.index.json`` and, for a
        Hugging Face model, its ``config.json``, so that ``AutoModel...from_pretrained(path)`` loads it. Every rank
        writes the slices it holds; the model is never gathered on one rank. Call on every rank."""
        assert self.lightning_module is not None
        if self._data_parallel.state_access() is not None:
            raise NotImplementedError(
                "save_hf_checkpoint with zero_backend='deepspeed': save with trainer.save_checkpoint(path), then"
                " `lightning-mgpu consolidate path out --format safetensors`."
            )
        return sharded_checkpoint.save_hf_checkpoint(self.lightning_module, path, shard_bytes(max_shard_size))
