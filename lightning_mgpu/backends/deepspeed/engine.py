"""``zero_backend="deepspeed"``: the data-parallel dimension runs through a DeepSpeed engine.

``deepspeed.initialize`` gets the step runner (so a step that calls ``self.model(...)`` directly still runs inside
the engine's forward), the user's own optimizer from ``configure_optimizers`` and a config completed from the
Trainer (``deepspeed_config.build_config``). Lightning keeps driving the loop and steps the LR schedulers itself;
the strategy hands backward and the optimizer step to this engine:

- backward: ``engine.backward(loss, scale_wrt_gas=False)`` (Lightning already divided the loss by
  ``accumulate_grad_batches``). The backward that runs inside Lightning's optimizer step is marked as the
  accumulation boundary (``set_gradient_accumulation_boundary``): there ZeRO-0/1 reduce and every stage moves
  the gradients into its partitions, as under Lightning's own DeepSpeedStrategy; ZeRO-2/3 reduce-scatter during
  every backward.
- optimizer step: the closure (forward + backward) runs, the ``on_before_optimizer_step`` hooks run, then
  ``engine.step()`` clips by the global norm (``gradient_clipping``) and steps.

Checkpoints keep the engine's loss scaler and step counters beside the torch backend's format (:meth:`state_dict`),
so an fp16 resume continues the dynamic scale exactly. At teardown :meth:`release` gives the user's module and
optimizer back as plain torch objects with the trained values (``deepspeed_release``).

The engine config is the user's plus the Trainer's values. Without a ``deepspeed_config`` its ZeRO settings are
those of Lightning's ``DeepSpeedStrategy(stage=N)`` (``overlap_comm``, 2e8-element buckets, ...: the same engine,
and the same speed); a given config keeps DeepSpeed's own defaults for what it leaves unset, as under
``DeepSpeedStrategy(config=...)`` (a ``ds_config.json`` means here what it means to ``deepspeed.initialize``).

The CPU path uses DeepSpeed's CPU accelerator and the job's gloo group; on GPUs DeepSpeed picks CUDA and the
job's NCCL group. The first use on CPU compiles DeepSpeed's ``deepspeed_shm_comm`` op once (~30 s, cached in
``~/.cache/torch_extensions`` or ``$TORCH_EXTENSIONS_DIR``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.model_helpers import is_overridden
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import Tensor, nn
from torch.optim import LBFGS, Optimizer

from lightning_mgpu._compat.lightning import call_callback_hooks, call_lightning_module_hook, fit_data_source
from lightning_mgpu.backends.deepspeed.config import DeepSpeedConfig, build_config, check_config
from lightning_mgpu.backends.deepspeed.release import DeepSpeedRelease
from lightning_mgpu.backends.deepspeed.states import DeepSpeedStates
from lightning_mgpu.options import ParallelOptions

if TYPE_CHECKING:
    import lightning.pytorch as pl
    from torch.distributed import ProcessGroup
    from torch.distributed.device_mesh import DeviceMesh

    from lightning_mgpu.layout import ParallelLayout, Size
    from lightning_mgpu.parallel.data import OptimizerStateSharding
    from lightning_mgpu.parallel.run import RunPrecision
    from lightning_mgpu.patches import PatchLog


def check(layout: ParallelLayout, options: ParallelOptions) -> None:
    """``zero_backend='deepspeed'``: one layout against the DeepSpeed engine and its config."""
    check_requested(options, layout.zero_stage, layout.tensor_parallel_size, layout.pipeline_parallel_size)


def check_requested(options: ParallelOptions, zero_stage: int | str, tensor_size: Size, pipeline_size: Size) -> None:
    """``zero_backend='deepspeed'``: the DeepSpeed engine's layouts and config, judged before launch on the sizes
    as given (``"auto"`` ones are judged per candidate by :func:`check`)."""
    if options.zero_backend != "deepspeed":
        return
    why = composition_error(tensor_size, pipeline_size)
    if why is not None:
        raise ValueError(why)
    if options.cpu_offload:
        raise ValueError(
            "`cpu_offload=True` is the torch backend's offload; with zero_backend='deepspeed' put"
            " {'zero_optimization': {'offload_optimizer': {'device': 'cpu'}, 'offload_param': {'device': 'cpu'}}}"
            " in deepspeed_config instead, and remove cpu_offload."
        )
    if zero_stage != "auto":  # checked against each candidate stage when the Trainer is built
        check_config(options.deepspeed_config, zero_stage)


def composition_error(tensor_parallel_size: Size, pipeline_parallel_size: Size) -> str | None:
    """Why a layout cannot run with the DeepSpeed engine (``None`` when it can); checked before launch."""
    if pipeline_parallel_size != 1 and pipeline_parallel_size != "auto":
        return (
            f"zero_backend='deepspeed' runs data parallelism only; pipeline_parallel_size={pipeline_parallel_size}"
            " would need DeepSpeed's own PipelineEngine (ZeRO <= 1, its PipelineModule) instead of torch's"
            " pipelining, which the strategy uses. Use zero_backend='torch' with pipelines (ZeRO 0-3 work there),"
            " or pipeline_parallel_size=1."
        )
    if tensor_parallel_size != 1 and tensor_parallel_size != "auto":
        return (
            f"zero_backend='deepspeed' runs data parallelism only; tensor_parallel_size={tensor_parallel_size}"
            " shards parameters as DTensors, which DeepSpeed's ZeRO partitioning does not handle (it flattens"
            " local tensors). Use zero_backend='torch' with tensor parallelism (ZeRO 0-3 work there), or"
            " tensor_parallel_size=1."
        )
    return None


class DeepSpeedEngineRunner:
    """Builds the DeepSpeed engine for a fit and runs backward and the optimizer step through it: the
    :class:`~lightning_mgpu.parallel.run.DataParallelEngine` of ``zero_backend="deepspeed"``."""

    applies_torch_wraps = False  # the engine is the data-parallel wrap
    restores_by_snapshot = False  # the engine's changes are undone in place (`release`)

    def __init__(self, config: DeepSpeedConfig) -> None:
        self.config = config
        self.engine: Any | None = None
        self.optimizer: Optimizer | None = None
        self._stepping = False  # inside Lightning's optimizer step: its backward ends the accumulation window
        self.param_groups: list[list[nn.Parameter]] = []  # the user's groups, before DeepSpeed flattens them
        self._release: DeepSpeedRelease | None = None
        self._released_state: dict[str, object] = {}

    def state_access(self) -> DeepSpeedStates:
        """The checkpointer reads and writes DeepSpeed's partitions (same format as the torch backend's)."""
        return DeepSpeedStates(self)

    def gathers_fp8_weights(self, layout: ParallelLayout) -> bool:
        return False  # DeepSpeed's own partitions: no FSDP2 all-gather to run in fp8

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
        """Nothing to wire: the engine steps (and partitions) the one optimizer itself."""
        return []

    def checkpoint_entries(self) -> dict[str, object]:
        """The engine's loss scaler and step counters, under :data:`CHECKPOINT_KEY`."""
        return {CHECKPOINT_KEY: self.state_dict()}

    def load_checkpoint_entries(self, loaded: Mapping[str, object]) -> None:
        state = loaded.get(CHECKPOINT_KEY)
        self.load_state_dict(state if isinstance(state, dict) else None)

    def wrap(
        self,
        runner: nn.Module,
        optimizers: list[Optimizer],
        trainer: pl.Trainer,
        layout: ParallelLayout,
        precision: str,
        dp_group: ProcessGroup,
    ) -> nn.Module:
        """Wrap ``runner`` (and the single optimizer, when fitting) in a DeepSpeed engine; return the engine."""
        import deepspeed

        if self.engine is not None:
            # validate/test/predict after fit reuse the engine; its parameters are already DeepSpeed's.
            if trainer.state.fn == TrainerFn.FITTING and optimizers and optimizers[0] is not self.optimizer:
                raise RuntimeError(
                    "zero_backend='deepspeed' builds one DeepSpeed engine per strategy, and this one has trained"
                    " already. Create a new Trainer with a new HybridStrategy for another `fit` (resume with"
                    " ckpt_path=...)."
                )
            return self.engine
        if len(optimizers) > 1:
            raise ValueError(
                f"zero_backend='deepspeed' trains with one optimizer, but configure_optimizers returned"
                f" {len(optimizers)}. Return one optimizer (param groups can differ in hyperparameters), or use"
                " zero_backend='torch'."
            )
        if not trainer.lightning_module.automatic_optimization:
            raise ValueError(
                "zero_backend='deepspeed' runs automatic optimization only: the engine must know which backward ends"
                " a step. Remove `self.automatic_optimization = False` (or use zero_backend='torch')."
            )
        if optimizers and isinstance(optimizers[0], LBFGS):
            raise ValueError("zero_backend='deepspeed' cannot step LBFGS (it re-evaluates the closure). Use AdamW/SGD.")
        config = build_config(
            self.config,
            layout.zero_stage,
            precision,
            trainer.gradient_clip_val,
            trainer.gradient_clip_algorithm,
            trainer.accumulate_grad_batches,
            _micro_batch_size(trainer),
            layout.data_parallel_size,
        )
        if is_overridden("configure_gradient_clipping", trainer.lightning_module):
            rank_zero_warn(
                "`configure_gradient_clipping` is not called with zero_backend='deepspeed': DeepSpeed clips by the"
                " global norm itself, with Trainer(gradient_clip_val=...)."
            )
        optimizer = optimizers[0] if optimizers else None
        self.param_groups = [list(group["params"]) for group in optimizer.param_groups] if optimizer else []
        self._release, self._released_state = DeepSpeedRelease(runner, optimizer), {}
        self.optimizer = optimizer
        self.engine, *_ = deepspeed.initialize(
            model=runner,
            optimizer=optimizer,
            config=config,
            mpu=_DataParallelGroups(dp_group),
            dist_init_required=False,
        )
        if optimizer is not None:
            self._release.route_zero_grad(optimizer, self.engine.optimizer)
        return self.engine

    def release(self, module: nn.Module) -> None:
        """The user's module and optimizer back as plain torch objects holding the trained values, the engine
        destroyed (``deepspeed_release``); a later fit or validate builds a new engine. Collective."""
        if self.engine is None or self._release is None:
            return
        self._released_state = self.state_dict()  # a save after fit still records the loss scaler and counters
        self._release.release(self, module)
        self.engine, self.optimizer, self.param_groups, self._release = None, None, [], None

    def backward(
        self,
        loss: Tensor,
        module: pl.LightningModule,
        precision: Precision,
        roots: list[nn.Module],
        default: Callable[[], Tensor],
    ) -> Tensor:
        """Callbacks' ``on_before/after_backward`` around the engine's backward (which owns loss scaling), in place
        of Lightning's."""
        assert self.engine is not None
        loss = Precision.pre_backward(precision, loss, module)
        self.engine.set_gradient_accumulation_boundary(self._stepping)
        self.engine.backward(loss, scale_wrt_gas=False)
        return Precision.post_backward(precision, loss, module)

    def optimizer_step(
        self,
        optimizer: Optimizer,
        closure: Callable[[], object],
        module: pl.LightningModule,
        default: Callable[[], object],
    ) -> object:
        """The closure, the ``on_before_optimizer_step`` hooks and the engine's step, in place of Lightning's."""
        assert self.engine is not None
        self._stepping = True
        try:
            result = closure()
        finally:
            self._stepping = False
        trainer = module.trainer
        # Lightning's clipping is skipped: the gradients are DeepSpeed's partitions, which it clips itself.
        call_callback_hooks(trainer, "on_before_optimizer_step", optimizer)
        call_lightning_module_hook(trainer, "on_before_optimizer_step", optimizer)
        if result is None and module.automatic_optimization:
            return result  # training_step returned None: no backward ran, nothing to step
        self.engine.set_gradient_accumulation_boundary(True)
        self.engine.step()
        return result

    def state_dict(self) -> dict[str, Any]:
        """What DeepSpeed's own checkpoints keep beside weights and optimizer states: the loss scaler (its scale,
        iteration and hysteresis counters under fp16; a fixed scale otherwise) and the engine's step counters.
        The same on every rank (overflows are agreed over the group), so rank 0's copy in the checkpoint serves all."""
        if self.engine is None:
            return dict(self._released_state)
        state: dict[str, Any] = {name: getattr(self.engine, name) for name in _ENGINE_COUNTERS}
        scaler = getattr(self.engine.optimizer, "loss_scaler", None)
        if scaler is not None:
            state["loss_scaler"] = {
                key: value.clone() if isinstance(value, Tensor) else value
                for key, value in vars(scaler).items()
                if isinstance(value, (bool, int, float, Tensor))
            }
        return state

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        """Put back :meth:`state_dict`'s values (a checkpoint of the torch backend has none: nothing changes)."""
        if not state or self.engine is None:
            return
        for name in _ENGINE_COUNTERS:
            if name in state:
                setattr(self.engine, name, state[name])
        scaler = getattr(self.engine.optimizer, "loss_scaler", None)
        saved = state.get("loss_scaler") or {}
        if scaler is None or not saved:
            return
        if bool(saved.get("dynamic")) != bool(getattr(scaler, "dynamic", False)):
            rank_zero_warn(
                "The checkpoint's DeepSpeed loss scaler is "
                f"{'dynamic' if saved.get('dynamic') else 'static'}, this run's is not: it starts afresh."
            )
            return
        for key, value in saved.items():
            if key in vars(scaler):
                setattr(scaler, key, value.clone() if isinstance(value, Tensor) else value)


# Counters DeepSpeed's engine keeps and its own checkpoints restore.
_ENGINE_COUNTERS = ("global_steps", "global_samples", "skipped_steps")

# Where a checkpoint's Lightning dict keeps `DeepSpeedEngineRunner.state_dict()`.
CHECKPOINT_KEY = "deepspeed_engine"


class _DataParallelGroups:
    """DeepSpeed's ``mpu`` interface: the engine reduces and partitions over the job's data-parallel group."""

    def __init__(self, dp_group: ProcessGroup) -> None:
        import torch.distributed as dist

        self._group = dp_group
        self._rank = dist.get_rank(dp_group)
        self._size = dist.get_world_size(dp_group)

    def get_data_parallel_group(self) -> ProcessGroup:
        return self._group

    def get_data_parallel_rank(self) -> int:
        return self._rank

    def get_data_parallel_world_size(self) -> int:
        return self._size

    def get_model_parallel_group(self) -> None:
        return None

    def get_model_parallel_rank(self) -> int:
        return 0

    def get_model_parallel_world_size(self) -> int:
        return 1


def _micro_batch_size(trainer: pl.Trainer) -> int:
    """The train dataloader's batch size (as Lightning's DeepSpeedStrategy reads it); 1 when it has none."""
    source = fit_data_source(trainer)
    if not source.is_defined():
        return 1
    loader = source.dataloader()
    batch_size = getattr(getattr(loader, "batch_sampler", None), "batch_size", None)
    return batch_size if isinstance(batch_size, int) and batch_size > 0 else 1


def zero_bytes_per_param(stage: int, dp: int) -> dict[str, float]:
    """The ZeRO paper's bytes per parameter on each of ``dp`` ranks for fp32 AdamW under DeepSpeed, right after
    backward: K = 12 (an fp32 master partition and two moments; DeepSpeed keeps the master beside the fp32 module
    even in fp32 training). At the accumulation boundary ZeRO-1 moves the reduced gradients into its partition, so
    after backward it holds ZeRO-2's gradient memory; ZeRO-3 also partitions the parameters."""
    return {"params": 4 / dp if stage == 3 else 4.0, "grads": 4 / dp, "optim": 12 / dp}


def memory_per_rank(engine: Any, module: nn.Module, optimizer: Optimizer) -> dict[str, int]:
    """Bytes this rank holds in parameters (its ZeRO-3 partition), gradients (whole, or DeepSpeed's reduced
    partitions: ZeRO-2 keeps the whole parameters overlapping its partition) and optimizer state (the user's
    optimizer's states plus DeepSpeed's fp32 master partitions). For tests and benchmarks, right after backward."""
    import torch

    zero = engine.optimizer
    params = list(module.parameters())
    grads = [p.grad for p in params if p.grad is not None]
    for name in ("averaged_gradients", "all_grad_tensors", "grad_partitions_flat_buffer"):
        grads += _tensors(getattr(zero, name, None))
    masters = _tensors(getattr(zero, "single_partition_of_fp32_groups", None))
    masters += _tensors(getattr(zero, "fp32_partitioned_groups_flat", None))
    state = [t for s in optimizer.state.values() for t in s.values() if torch.is_tensor(t) and t.dim() > 0]
    # DeepSpeed hands out views of flat buffers: count each storage once.
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in grads}
    return {
        "params": sum(_bytes(getattr(p, "ds_tensor", p)) for p in params),
        "grads": sum(storages.values()),
        "optim": sum(_bytes(t) for t in state + masters),
    }


def _tensors(value: object) -> list[Tensor]:
    if isinstance(value, Tensor):
        return [value]
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, (list, tuple)):
        return [t for item in value for t in _tensors(item)]
    return []


def _bytes(tensor: Tensor) -> int:
    return tensor.numel() * tensor.element_size()
