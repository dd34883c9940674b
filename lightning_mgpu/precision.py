"""HybridPrecision: the Precision plugin that matches HybridStrategy.

One plugin serves every layout (data, tensor and pipeline parallel, ZeRO 0-3):

- ``*-mixed``: autocast on the device type around each forward (``forward_context``; a pipeline stage enters the
  same context), fp32 master weights. Numerics do not depend on the layout, so a sharded run tracks the
  single-process run of the same precision.
- ``16-mixed`` adds loss scaling with *one* scaler state for the whole job: an inf/nan in any gradient shard on any
  rank (data, tensor or pipeline) skips the step on every rank and lowers the scale everywhere.
- ``*-true``: the module is cast to the half dtype (parameters, gradients and optimizer states in half).
- ``fp8-mixed``: ``nn.Linear`` layers run their matmuls in float8 through torchao, everything else in bf16 autocast.
- ``param_dtype`` / ``reduce_dtype`` become FSDP2's ``MixedPrecisionPolicy`` for the data-parallel wrap
  (``replicate`` at ZeRO 0/1, ``fully_shard`` at ZeRO 2/3).

Gradients are clipped by their true global norm, whichever way they are split over ranks, after unscaling.
"""

from __future__ import annotations

import importlib.util
import logging
from collections import defaultdict
from collections.abc import Callable, Generator
from collections.abc import Set as AbstractSet
from contextlib import contextmanager, nullcontext
from typing import TYPE_CHECKING, Any, Literal, TypeVar

import torch
import torch.distributed as dist
from lightning.fabric.utilities.types import Optimizable
from lightning.pytorch.plugins.precision import DoublePrecision, HalfPrecision, MixedPrecision, Precision
from lightning.pytorch.utilities import GradClipAlgorithmType
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from lightning_utilities.core.apply_func import apply_to_collection
from torch import Tensor, nn
from torch.distributed.tensor import DTensor
from torch.optim import LBFGS, Optimizer
from typing_extensions import override

from lightning_mgpu._compat.amp import ScalerHooks, non_finite_check_and_unscale_, sparse_values
from lightning_mgpu._compat.lightning import (
    DtypeContextManager,
    after_closure,
    convert_fp_tensor,
    optimizer_handles_unscaling,
)
from lightning_mgpu.parallel.blocks import is_float8_linear
from lightning_mgpu.parallel.grads import clip_grad_norm_, clip_grad_value_

if TYPE_CHECKING:
    from contextlib import AbstractContextManager

    from lightning.pytorch.accelerators import Accelerator
    from torch.distributed import ProcessGroup
    from torch.distributed.fsdp import MixedPrecisionPolicy

_Data = TypeVar("_Data")
_PrecisionName = Literal["32-true", "bf16-mixed", "16-mixed", "bf16-true", "16-true", "fp8-mixed"]
SUPPORTED = ("32-true", "bf16-mixed", "16-mixed", "bf16-true", "16-true", "fp8-mixed")

_AUTOCAST_DTYPE = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16, "fp8-mixed": torch.bfloat16}
_TRUE_DTYPE = {"bf16-true": torch.bfloat16, "16-true": torch.float16}
_DTYPES = {
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "16": torch.float16,
    "fp16": torch.float16,
    "float16": torch.float16,
    "half": torch.float16,
    "32": torch.float32,
    "fp32": torch.float32,
    "float32": torch.float32,
}
# float8 matmuls need both dimensions of the weight to be multiples of 16 (torch._scaled_mm's rule on GPUs).
_FP8_MULTIPLE = 16
_FP8_MIN_CAPABILITY = (8, 9)  # Ada (sm89), Hopper (sm90), Blackwell


def check_precision_layout(precision: str, tensor_parallel_size: int) -> None:
    """A precision the layout cannot run with (the planner checks its candidates with it, without torchao)."""
    if precision == "fp8-mixed" and tensor_parallel_size > 1:
        raise NotImplementedError(
            f"HybridPrecision('fp8-mixed') with tensor_parallel_size={tensor_parallel_size} is not supported yet."
            " Use 'bf16-mixed' with tensor parallelism, or tensor_parallel_size=1 with fp8-mixed."
        )


class HybridPrecision(Precision):
    """Precision for :class:`~lightning_mgpu.HybridStrategy`.

    Args:
        precision: ``"32-true"``, ``"bf16-mixed"``, ``"16-mixed"`` (fp16 autocast + loss scaling, also on CPU),
            ``"bf16-true"``, ``"16-true"`` or ``"fp8-mixed"`` (torchao float8 Linear layers + bf16 autocast).
        device_type: where autocast runs; set by the strategy from its root device.
        param_dtype: dtype the data-parallel wrap casts parameters to for forward/backward (FSDP2
            ``MixedPrecisionPolicy.param_dtype``; at ZeRO 3 it also halves all-gather bytes). ``None`` (default)
            keeps fp32 weights under autocast: the same numerics in every layout. Only with ``*-mixed``.
        reduce_dtype: dtype gradients are reduced in over data-parallel ranks (FSDP2 ``reduce_dtype``), e.g.
            ``"bf16"`` to halve gradient traffic. ``None`` (default): the gradients' own dtype.
        fp8_emulate: run ``fp8-mixed`` through torchao's emulation (any device, slow; for testing on CPU).
        init_scale: the loss scaler's initial scale (``16-mixed`` only), as in ``torch.amp.GradScaler``.
        growth_interval: steps without overflow before the loss scale grows (``16-mixed`` only), as in
            ``torch.amp.GradScaler``.

    ``Trainer(precision=...)`` with :class:`~lightning_mgpu.HybridStrategy` selects this plugin at the precision
    Lightning chose (on CPU Lightning turns ``"16-mixed"`` into ``"bf16-mixed"``, with a warning). Options beyond
    the name, ``"fp8-mixed"``, and fp16 with loss scaling on CPU are given as
    ``Trainer(plugins=[HybridPrecision(...)])``.
    """

    precision: str  # type: ignore[assignment]  # Lightning's names and "fp8-mixed"

    def __init__(
        self,
        precision: _PrecisionName | str = "32-true",
        device_type: str = "cpu",
        *,
        param_dtype: str | torch.dtype | None = None,
        reduce_dtype: str | torch.dtype | None = None,
        fp8_emulate: bool = False,
        init_scale: float = 2.0**16,
        growth_interval: int = 2000,
    ) -> None:
        precision = str(precision)
        if precision not in SUPPORTED:
            raise ValueError(f"HybridPrecision does not support precision={precision!r}. Choose one of {SUPPORTED}.")
        self.precision = precision
        self.param_dtype = _dtype("param_dtype", param_dtype)
        self.reduce_dtype = _dtype("reduce_dtype", reduce_dtype)
        if self.param_dtype is not None and precision not in _AUTOCAST_DTYPE:
            raise ValueError(
                f"`param_dtype` applies to the mixed precisions {tuple(_AUTOCAST_DTYPE)}; with precision={precision!r}"
                " the parameters already have their dtype."
            )
        if not isinstance(fp8_emulate, bool):
            raise ValueError(f"`fp8_emulate` must be True or False, got {fp8_emulate!r}.")
        if fp8_emulate and precision != "fp8-mixed":
            raise ValueError(f"`fp8_emulate=True` applies to precision='fp8-mixed', not {precision!r}.")
        if precision == "fp8-mixed" and importlib.util.find_spec("torchao") is None:
            raise ImportError(
                "HybridPrecision('fp8-mixed') needs torchao's float8 training: `pip install 'lightning-mgpu[fp8]'`"
                " (or `pip install torchao`)."
            )
        self.fp8_emulate = fp8_emulate
        # Set by the strategy for ZeRO-3 (FSDP2): float8 weights all-gathered in float8 (half of bf16's bytes), their
        # scales precomputed after each optimizer step in one all-reduce (torchao's FSDP2 float8 recipe).
        self.float8_all_gather = False
        self._scaler_kwargs = {"init_scale": float(init_scale), "growth_interval": int(growth_interval)}
        self.scaler: JobGradScaler | None = None
        self._device_type = ""
        self.device_type = device_type
        # Set by the strategy: the group over which gradient norms of different shards must be summed, and the
        # parameters (tied copies) whose gradients another member of that group counts.
        self.grad_norm_group: ProcessGroup | None = None
        self.grads_counted_elsewhere: Callable[[], AbstractSet[int]] = frozenset

    # ----------------------------------------------------------------------------------------------- construction
    @property
    def device_type(self) -> str:
        return self._device_type

    @device_type.setter
    def device_type(self, device_type: str) -> None:
        if device_type == self._device_type:
            return
        self._device_type = device_type
        if self.precision == "16-mixed":
            state = self.scaler.state_dict() if self.scaler is not None else None
            self.scaler = JobGradScaler(device_type, **self._scaler_kwargs)
            if state:
                self.scaler.load_state_dict(state)

    @classmethod
    def from_lightning(cls, plugin: Precision, device_type: str) -> HybridPrecision:
        """Translate the plugin Lightning picked from ``Trainer(precision=...)``."""
        if isinstance(plugin, HybridPrecision):
            plugin.device_type = device_type
            plugin._check_device()  # the strategy knows the device when the Trainer is built: fail before launching
            return plugin
        if isinstance(plugin, MixedPrecision):
            converted = cls(plugin.precision, device_type)
            if plugin.scaler is not None and converted.scaler is not None:
                # Keep the user's scaler settings (initial scale, growth and backoff), but one job-wide scaler state.
                settings = plugin.scaler.state_dict()
                if settings:
                    converted.scaler.load_state_dict(settings)
            return converted
        if isinstance(plugin, HalfPrecision):
            return cls(plugin.precision, device_type)
        if type(plugin) is Precision:
            return cls("32-true", device_type)
        name = "64-true" if isinstance(plugin, DoublePrecision) else type(plugin).__name__
        raise ValueError(f"HybridStrategy does not support the precision {name!r}. Choose one of {SUPPORTED}.")

    def _check_device(self) -> None:
        if self.precision == "fp8-mixed" and self.device_type == "cpu" and not self.fp8_emulate:
            raise ValueError(
                "HybridPrecision('fp8-mixed') has no float8 matmul kernels on CPU. Pass `fp8_emulate=True` to run"
                " torchao's float8 emulation (for testing; slow), or use 'bf16-mixed'."
            )

    @classmethod
    def handed_over(cls, plugin: Precision | None, accelerator: Accelerator | None = None) -> HybridPrecision | None:
        """The plugin the Trainer hands the strategy (when it is built), translated then, so that a precision this
        plugin cannot run fails before any launch.

        Lightning's choice is the one that runs: its plugin's ``precision`` (on CPU ``Trainer(precision="16-mixed")``
        arrives as ``"bf16-mixed"``, and Lightning has said so). With the ``accelerator`` already chosen as the CPU,
        a ``HybridPrecision`` the CPU cannot run fails here; otherwise its device type is set once the devices are
        known (``from_lightning``).
        """
        from lightning.pytorch.accelerators import CPUAccelerator

        if plugin is None or (isinstance(plugin, HybridPrecision) and not isinstance(accelerator, CPUAccelerator)):
            return plugin
        device_type = "cpu" if isinstance(plugin, HybridPrecision) else getattr(plugin, "device", None) or "cpu"
        return cls.from_lightning(plugin, device_type)

    # ------------------------------------------------------------------------------------------------- policies
    def mp_policy(self) -> MixedPrecisionPolicy | None:
        """The FSDP2 ``MixedPrecisionPolicy`` for the data-parallel wrap, or ``None`` when FSDP2's default fits."""
        if self.param_dtype is None and self.reduce_dtype is None:
            return None
        from torch.distributed.fsdp import MixedPrecisionPolicy

        return MixedPrecisionPolicy(param_dtype=self.param_dtype, reduce_dtype=self.reduce_dtype)

    @property
    def autocast_dtype(self) -> torch.dtype | None:
        return _AUTOCAST_DTYPE.get(self.precision)

    @property
    def true_dtype(self) -> torch.dtype | None:
        return _TRUE_DTYPE.get(self.precision)

    # --------------------------------------------------------------------------------------------- module / data
    @override
    def convert_module(self, module: nn.Module) -> nn.Module:
        if self.true_dtype is not None:
            return module.to(dtype=self.true_dtype)
        if self.precision == "fp8-mixed":
            self._check_device()
            convert_to_float8(module, self.fp8_emulate, self.device_type, all_gather=self.float8_all_gather)
        return module

    @override
    def tensor_init_context(self) -> AbstractContextManager[None]:
        return DtypeContextManager(self.true_dtype) if self.true_dtype is not None else nullcontext()

    @override
    def module_init_context(self) -> AbstractContextManager[None]:
        return self.tensor_init_context()

    @override
    def convert_input(self, data: _Data) -> _Data:
        if self.true_dtype is None:
            return data
        return apply_to_collection(data, function=convert_fp_tensor, dtype=Tensor, dst_type=self.true_dtype)

    @contextmanager
    def autocast(self) -> Generator[None, None, None]:
        """The compute context of one forward: what every data/tensor rank and every pipeline stage runs under."""
        if self.autocast_dtype is not None:
            with torch.autocast(self.device_type, dtype=self.autocast_dtype):
                yield
        elif self.true_dtype is not None:
            with DtypeContextManager(self.true_dtype):  # tensors made inside forward get the half dtype
                yield
        else:
            yield

    @override
    @contextmanager
    def forward_context(self) -> Generator[None, None, None]:
        with self.autocast():
            yield

    # ------------------------------------------------------------------------------------------- loss scaling
    def scale_loss(self, loss: Tensor) -> Tensor:
        """Multiply ``loss`` by the job's loss scale (``16-mixed``); unchanged otherwise. Pipeline stages call this."""
        return self.scaler.scale(loss) if self.scaler is not None else loss

    @override
    def pre_backward(self, tensor: Tensor, module: Any) -> Tensor:  # Lightning's Precision and Fabric's disagree
        return super().pre_backward(self.scale_loss(tensor), module)

    @override
    def optimizer_step(  # type: ignore[override]
        self, optimizer: Optimizable, model: Any, closure: Callable[[], object], **kwargs: object
    ) -> Any:
        if self.scaler is None:
            output = super().optimizer_step(optimizer, model=model, closure=closure, **kwargs)
            if self.float8_all_gather and isinstance(model, nn.Module):
                precompute_float8_scales(model)  # the next forward's all-gathers use them
            return output
        if isinstance(optimizer, LBFGS):
            raise MisconfigurationException("16-mixed (loss scaling) and the LBFGS optimizer are not compatible.")
        closure_result = closure()
        # Backward was skipped (training_step returned None): nothing to unscale or step.
        skip = closure_result is None and model.automatic_optimization
        if not skip and not optimizer_handles_unscaling(optimizer):
            # Unscale before `on_before_optimizer_step` and clipping, which must see true gradients. This is where
            # the found-inf flag is all-reduced over the whole job.
            self.scaler.unscale_(optimizer)  # type: ignore[arg-type]
        after_closure(self, model, optimizer)
        if skip:
            return closure_result
        # Skips `optimizer.step()` on every rank alike when any rank found an inf/nan.
        output = self.scaler.step(optimizer, **kwargs)  # type: ignore[arg-type]
        self.scaler.update()
        return output

    @override
    def clip_gradients(
        self,
        optimizer: Optimizer,
        clip_val: int | float = 0.0,
        gradient_clip_algorithm: GradClipAlgorithmType = GradClipAlgorithmType.NORM,
    ) -> None:
        if self.scaler is not None and clip_val > 0 and optimizer_handles_unscaling(optimizer):
            raise RuntimeError(
                f"{type(optimizer).__qualname__} unscales gradients inside `step` (a fused optimizer?), so gradients"
                " cannot be clipped under 16-mixed."
            )
        super().clip_gradients(optimizer, clip_val, gradient_clip_algorithm)

    @override
    def clip_grad_by_norm(self, optimizer: Optimizer, clip_val: int | float) -> None:
        clip_grad_norm_(
            list(self.main_params(optimizer)),
            clip_val,
            cross_stage_group=self.grad_norm_group,
            counted_elsewhere=self.grads_counted_elsewhere(),
        )

    @override
    def clip_grad_by_value(self, optimizer: Optimizer, clip_val: int | float) -> None:
        clip_grad_value_(self.main_params(optimizer), clip_val)

    @override
    def state_dict(self) -> dict[str, Any]:
        return self.scaler.state_dict() if self.scaler is not None else {}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if self.scaler is not None and state_dict:
            self.scaler.load_state_dict(state_dict)


class JobGradScaler(ScalerHooks):
    """torch's ``ShardedGradScaler`` with the found-inf flag all-reduced over the *whole job*.

    Pipeline stages and tensor-parallel ranks hold different gradient shards, so the data-parallel group is not
    enough: every rank's flag goes into one all-reduce over the default (world) group, and every rank then skips
    or steps alike and keeps the same scale. DTensor gradients (FSDP2 shards, tensor-parallel shards) are checked
    and unscaled through their local tensors.
    """

    def __init__(self, device: str = "cpu", **kwargs: Any) -> None:
        super().__init__(device, process_group=None, **kwargs)  # None: the world group, resolved at call time

    @override
    def unscale_(self, optimizer: Optimizer) -> None:
        # Pipeline stages before the last never scale a loss themselves, yet hold scaled gradients.
        self.ensure_scale()
        if dist.is_available() and dist.is_initialized():
            return super().unscale_(optimizer)
        return self.unscale_locally(optimizer)  # single process: nothing to agree on

    @override
    def unscale_grads(
        self, optimizer: Optimizer, inv_scale: Tensor, found_inf: Tensor, allow_fp16: bool = True
    ) -> dict[torch.device, Tensor]:
        grads: dict[torch.device, dict[torch.dtype, list[Tensor]]] = defaultdict(lambda: defaultdict(list))
        with torch.no_grad():
            for group in optimizer.param_groups:
                for param in group["params"]:
                    grad = param.grad
                    if grad is None:
                        continue
                    grad = grad.to_local() if isinstance(grad, DTensor) else grad
                    if grad.is_sparse:
                        grad = sparse_values(grad)
                    grads[grad.device][grad.dtype].append(grad)
            found: dict[torch.device, Tensor] = {}
            for device, by_dtype in grads.items():
                found[device] = found_inf.to(device)
                device_inv_scale = inv_scale.to(device)
                for tensors in by_dtype.values():
                    non_finite_check_and_unscale_(tensors, found[device], device_inv_scale)
        if not found:  # a rank without gradients still takes part in the all-reduce
            found[found_inf.device] = found_inf
        return found


def convert_to_float8(module: nn.Module, emulate: bool, device_type: str, all_gather: bool = False) -> int:
    """Swap ``nn.Linear`` layers whose dimensions are multiples of 16 for torchao's ``Float8Linear``, in place.

    Parameter names and state-dict keys are unchanged. Returns the number of layers converted. On CUDA, devices
    below compute capability 8.9 have no float8 matmuls: an error says so unless ``emulate``. ``all_gather``: the
    weights, once FSDP2 shards them (ZeRO-3), are all-gathered in float8 (``enable_fsdp_float8_all_gather``).
    """
    if device_type == "cuda" and not emulate:
        capability = torch.cuda.get_device_capability()
        if capability < _FP8_MIN_CAPABILITY:
            raise RuntimeError(
                f"HybridPrecision('fp8-mixed') needs a GPU with compute capability >= 8.9 (Ada, Hopper, Blackwell);"
                f" this one is sm_{capability[0]}{capability[1]}. Use 'bf16-mixed', or fp8_emulate=True for testing."
            )
    elif device_type == "cpu" and not emulate:
        raise ValueError("HybridPrecision('fp8-mixed') on CPU needs `fp8_emulate=True`.")
    # torchao logs a warning per optional GPU kernel library it cannot load at import; irrelevant here.
    ao_logger = logging.getLogger("torchao")
    level = ao_logger.level
    ao_logger.setLevel(logging.ERROR)
    try:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    finally:
        ao_logger.setLevel(level)

    def eligible(child: nn.Module, fqn: str) -> bool:
        return (
            isinstance(child, nn.Linear)
            and child.in_features % _FP8_MULTIPLE == 0
            and child.out_features % _FP8_MULTIPLE == 0
        )

    before = sum(is_float8_linear(m) for m in module.modules())
    config = Float8LinearConfig(emulate=emulate, enable_fsdp_float8_all_gather=all_gather)
    convert_to_float8_training(module, module_filter_fn=eligible, config=config)
    converted = sum(is_float8_linear(m) for m in module.modules()) - before
    if converted == 0:
        rank_zero_warn(
            "fp8-mixed found no nn.Linear layer with both dimensions multiples of 16 to convert; this run is"
            " bf16-mixed."
        )
    return converted


def precompute_float8_scales(module: nn.Module) -> None:
    """The float8 scales of every FSDP2-sharded float8 weight of ``module``, in one all-reduce of their amaxes."""
    from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

    precompute_float8_dynamic_scale_for_fsdp(module)


def _dtype(name: str, value: str | torch.dtype | None) -> torch.dtype | None:
    if value is None or isinstance(value, torch.dtype):
        if value not in (None, torch.float32, torch.bfloat16, torch.float16):
            raise ValueError(f"`{name}` must be float32, bfloat16 or float16, got {value!r}.")
        return value
    if str(value).lower() in _DTYPES:
        return _DTYPES[str(value).lower()]
    raise ValueError(f"`{name}` must be a torch dtype or one of {sorted(_DTYPES)}, got {value!r}.")
