"""The strategy's non-size options: plain typed data at the bottom of the package, validated once, before any
process starts.

Here are the checks of values alone and the rule below; what needs a parallelism's own knowledge (the schedule
table, plan style names, the DeepSpeed engine's layouts) is that parallelism's ``check`` (``parallel.pipeline``,
``parallel.tensor``, ``deepspeed_config``), which the strategy runs with these (``layout_choice``).

The rule for options that act along one parallel dimension only (``sequence_parallel``, ``loss_parallel`` and
``tp_plan`` along tensor parallelism; ``pipeline_schedule``, ``num_microbatches``, ``stages_per_rank`` and
``pipeline_split`` along pipeline parallelism): set to anything but its default while that dimension has size 1,
the option is *refused*, naming the option, the dimension and both fixes. Whoever set it expected an effect, and a
silently ignored option hides a mistake in the layout. Defaults never trigger it. A size given as ``"auto"`` is
checked once it is resolved, when the ``Trainer`` is built; where the planner chooses among several layouts, each is
checked then and only those the options run with are offered to it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields
from datetime import timedelta
from typing import Any, Literal, get_args

StartMethod = Literal["auto", "popen", "fork", "spawn", "forkserver"]
START_METHODS = get_args(StartMethod)
ZERO_BACKENDS = ("torch", "deepspeed")
CHECKPOINT_FORMATS = ("sharded", "full")
ACTIVATION_CHECKPOINTING = (False, True, "full", "selective")
CONTEXT_PARALLEL_MODES = ("ring", "alltoall")


@dataclass(frozen=True)
class ParallelOptions:
    """How each parallelizer works (the layout, ``ParallelLayout``, says how many ways along every axis: dp, tp, pp,
    cp, ep, the ZeRO stage and HSDP's shard size)."""

    zero_backend: str = "torch"
    tp_plan: str | dict[str, str] | Callable[..., None] = "auto"
    sequence_parallel: bool = False
    loss_parallel: bool = False
    pipeline_schedule: str = "1F1B"
    num_microbatches: int | None = None
    stages_per_rank: int | None = None
    pipeline_split: str | list[str] = "auto"
    activation_checkpointing: bool | str | list[type] = False
    cpu_offload: bool = False
    checkpoint_format: str = "full"
    async_checkpoint: bool = False
    deepspeed_config: Any = None  # None, a dict or a JSON file's path (zero_backend="deepspeed")
    context_parallel_mode: str = "ring"  # how attention spans the sequence's shards (parallel/context/)
    compile: bool | dict[str, Any] = False  # torch.compile each block (True, or torch.compile's keyword arguments)
    global_batch_size: int | None = None  # samples per optimizer step on any world size (strategy/batch.py)
    find_unused_parameters: bool | None = None  # DDP's search for parameters without a gradient (data/unused_params.py)

    def __post_init__(self) -> None:
        _one_of("zero_backend", self.zero_backend, ZERO_BACKENDS)
        _one_of("checkpoint_format", self.checkpoint_format, CHECKPOINT_FORMATS)
        _one_of("context_parallel_mode", self.context_parallel_mode, CONTEXT_PARALLEL_MODES)
        if not (self.tp_plan == "auto" or isinstance(self.tp_plan, dict) or callable(self.tp_plan)):
            raise ValueError(
                f"`tp_plan` must be 'auto', a dict {{module_glob: style}} or a callable (module, tp_mesh),"
                f" got {self.tp_plan!r}."
            )
        if isinstance(self.tp_plan, dict):
            not_globs = [glob for glob in self.tp_plan if not isinstance(glob, str) or not glob]
            if not_globs:
                raise ValueError(
                    f"`tp_plan` keys are module-name globs (str, e.g. 'model.layers.*.mlp.up_proj'), got {not_globs}."
                )
        if not (self.pipeline_split == "auto" or _is_list_of_str(self.pipeline_split)):
            raise ValueError(
                f"`pipeline_split` must be 'auto' or a list of module names where stages begin,"
                f" got {self.pipeline_split!r}."
            )
        if not (self.find_unused_parameters is None or isinstance(self.find_unused_parameters, bool)):
            raise ValueError(
                "`find_unused_parameters` must be None (decided by the first step), True or False,"
                f" got {self.find_unused_parameters!r}."
            )
        if self.global_batch_size is not None and not _positive_int(self.global_batch_size):
            raise ValueError(
                "`global_batch_size` must be a positive integer (samples per optimizer step over all data-parallel"
                f" ranks) or None, got {self.global_batch_size!r}."
            )
        if self.num_microbatches is not None and not _positive_int(self.num_microbatches):
            raise ValueError(f"`num_microbatches` must be a positive integer or None, got {self.num_microbatches!r}.")
        if self.stages_per_rank is not None and not _positive_int(self.stages_per_rank):
            raise ValueError(f"`stages_per_rank` must be a positive integer or None, got {self.stages_per_rank!r}.")
        ac = self.activation_checkpointing
        classes = isinstance(ac, (list, tuple)) and len(ac) > 0 and all(isinstance(c, type) for c in ac)
        if not (classes or (not isinstance(ac, (list, tuple)) and ac in ACTIVATION_CHECKPOINTING)):
            raise ValueError(
                f"`activation_checkpointing` must be False, True, 'full', 'selective' or a non-empty list of module"
                f" classes (e.g. [MyBlock]), got {ac!r}."
            )
        for name in ("sequence_parallel", "loss_parallel", "cpu_offload", "async_checkpoint"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"`{name}` must be True or False, got {getattr(self, name)!r}.")
        if not (isinstance(self.compile, bool) or _is_str_keyed_dict(self.compile)):
            raise ValueError(
                "`compile` must be True, False or a dict of torch.compile keyword arguments (e.g."
                f" {{'mode': 'max-autotune', 'dynamic': True}}), got {self.compile!r}."
            )
        if self.async_checkpoint and self.checkpoint_format != "sharded":
            raise ValueError(
                "`async_checkpoint=True` writes sharded checkpoints in the background and needs"
                f" `checkpoint_format='sharded'`, got {self.checkpoint_format!r}."
            )

    def check_implemented(self) -> None:
        """Refuse, loudly, options this version accepts in its signature but does not implement yet."""
        pending: dict[str, bool] = {}
        missing = [name for name, requested in pending.items() if requested]
        if missing:
            raise NotImplementedError(
                f"HybridStrategy does not implement {', '.join(missing)} yet in this version; see the CHANGELOG"
                " for what is available. Remove the argument(s) to train with data parallelism and ZeRO."
            )

    def check_sizes(
        self,
        zero_stage: int | Literal["auto"],
        tensor_parallel_size: Any,
        pipeline_parallel_size: Any,
        auto: tuple[str, ...] = (),
        context_parallel_size: int = 1,
    ) -> None:
        """Options that need a given ZeRO stage or parallel size (see the module docstring for the rule).

        Sizes still ``"auto"`` are skipped: the strategy calls this again with the resolved sizes, naming in
        ``auto`` those that were resolved from ``"auto"``.
        """
        sizes = {
            "tensor_parallel_size": tensor_parallel_size,
            "pipeline_parallel_size": pipeline_parallel_size,
            "context_parallel_size": context_parallel_size,
        }
        defaults = {f.name: f.default for f in fields(self)}
        for dimension, options in _DIMENSION_OPTIONS.items():
            size = sizes[dimension]
            if size != 1:
                continue
            for name, purpose in options.items():
                value = getattr(self, name)
                if value != defaults[name]:
                    resolved = f" ({dimension}='auto' resolved to 1)" if dimension in auto else ""
                    raise ValueError(
                        f"`{name}={value!r}` {purpose} and needs {dimension} > 1, got 1{resolved}. Set {dimension}"
                        f" > 1, or remove `{name}`."
                    )
        if self.cpu_offload and zero_stage not in (3, "auto"):
            raise ValueError(
                f"`cpu_offload=True` offloads sharded parameters, gradients and optimizer states (FSDP2's"
                f" CPUOffloadPolicy) and needs zero_stage=3, got zero_stage={zero_stage}. Set zero_stage=3, or"
                f" remove cpu_offload."
            )
        if self.zero_backend != "deepspeed" and self.deepspeed_config is not None:
            raise ValueError(
                f"`deepspeed_config` configures the DeepSpeed engine and needs zero_backend='deepspeed', got"
                f" zero_backend={self.zero_backend!r}. Set zero_backend='deepspeed', or remove deepspeed_config."
            )


@dataclass(frozen=True)
class LaunchOptions:
    """How the processes start and meet: checked here, since a bad value would fail in every worker at once."""

    process_group_backend: str | None = None
    timeout: timedelta | int | float | None = None
    start_method: StartMethod = "auto"
    heartbeat_timeout: float | None = 60.0
    init_timeout: float | None = 600.0

    def __post_init__(self) -> None:
        _one_of("start_method", self.start_method, START_METHODS)
        object.__setattr__(self, "timeout", _timeout(self.timeout))
        _seconds_or_none("heartbeat_timeout", self.heartbeat_timeout, "no heartbeat")
        _seconds_or_none("init_timeout", self.init_timeout, "no bound on a run's start")
        if self.process_group_backend is not None:
            _check_backend(self.process_group_backend)

    def check_device(self, device_type: str) -> None:
        """A backend that has no collectives for the Trainer's devices (known when the Trainer is built)."""
        for device, name in _backend_parts(self.process_group_backend or ""):
            supported = _DEVICE_ONLY_BACKENDS.get(name)
            if device is None and supported is not None and device_type != supported:
                raise ValueError(
                    f"`process_group_backend={self.process_group_backend!r}` runs collectives on {supported} devices"
                    f" only, but the Trainer's devices are {device_type}. Remove process_group_backend to get the"
                    " devices' default ('gloo' on CPU, 'nccl' on CUDA), or name one per device ('cpu:gloo,cuda:nccl')."
                )


# Backends whose collectives exist for one device type only.
_DEVICE_ONLY_BACKENDS = {"nccl": "cuda", "xccl": "xpu"}


def _seconds_or_none(name: str, value: object, none_means: str) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int | float) or not value > 0):
        raise ValueError(f"`{name}` must be a positive number of seconds or None ({none_means}), got {value!r}.")


def _timeout(value: object) -> timedelta | None:
    """torch's ``init_process_group`` takes a timedelta only; seconds given as a number are converted."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (timedelta, int, float)):
        raise ValueError(
            f"`timeout` must be a datetime.timedelta or a number of seconds, got {value!r}."
            " Pass e.g. timeout=timedelta(minutes=30) (or timeout=1800)."
        )
    seconds = value.total_seconds() if isinstance(value, timedelta) else float(value)
    if not 0 < seconds < timedelta.max.total_seconds():
        raise ValueError(
            f"`timeout` must be positive and finite, got {value!r}. Pass e.g. timeout=timedelta(minutes=30)."
        )
    return value if isinstance(value, timedelta) else timedelta(seconds=seconds)


def _backend_parts(backend: str) -> list[tuple[str | None, str]]:
    """``'gloo'`` -> ``[(None, 'gloo')]``; torch's per-device form ``'cpu:gloo,cuda:nccl'`` -> one pair per device."""
    parts = []
    for part in backend.split(","):
        device, _, name = part.strip().rpartition(":")
        parts.append((device or None, name.lower()))
    return parts


def _check_backend(backend: Any) -> None:
    import torch.distributed as dist

    known = [name for name in dist.Backend.backend_list if name != dist.Backend.UNDEFINED]
    if not isinstance(backend, str) or not backend:
        raise ValueError(
            f"`process_group_backend` must be one of {known} or None (the devices' default), got {backend!r}."
        )
    for _, name in _backend_parts(backend):
        if name not in known:
            raise ValueError(
                f"`process_group_backend={backend!r}`: {name!r} is not a torch.distributed backend. Use one of"
                f" {known}, or remove process_group_backend to get the devices' default."
            )
        if not dist.is_backend_available(name):
            available = [b for b in known if dist.is_backend_available(b)]
            raise ValueError(
                f"`process_group_backend={backend!r}`: this torch build has no {name!r} backend. Use one of"
                f" {available}, or remove process_group_backend to get the devices' default."
            )


# Options that act along one parallel dimension only, and what they do there (the refusal's message).
_DIMENSION_OPTIONS = {
    "tensor_parallel_size": {
        "tp_plan": "says how modules are sharded across tensor-parallel ranks",
        "sequence_parallel": "shards activations along the sequence across tensor-parallel ranks",
        "loss_parallel": "keeps the LM head's logits sharded over the vocabulary across tensor-parallel ranks",
    },
    "pipeline_parallel_size": {
        "pipeline_schedule": "orders the forward and backward passes of pipeline stages",
        "num_microbatches": "cuts each batch into microbatches for the pipeline schedule",
        "stages_per_rank": "places several pipeline stages on each rank",
        "pipeline_split": "says where pipeline stages begin",
    },
    "context_parallel_size": {
        "context_parallel_mode": "says how attention spans the sequence's shards across context-parallel ranks",
    },
}


def refuse_compositions(subject: str, combinations: dict[str, bool], why: str) -> None:
    """Raise ``NotImplementedError`` naming every combination in ``combinations`` that is set (``True``) and does not
    compose with ``subject`` yet, followed by ``why`` (the reason and the fix)."""
    named = [name for name, present in combinations.items() if present]
    if named:
        raise NotImplementedError(f"{subject} does not compose with {', '.join(named)} yet: {why}")


def _one_of(name: str, value: object, allowed: tuple) -> None:
    if value not in allowed:
        raise ValueError(f"`{name}` must be one of {', '.join(map(repr, allowed))}, got {value!r}.")


def _positive_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _is_str_keyed_dict(value: object) -> bool:
    return isinstance(value, dict) and all(isinstance(key, str) for key in value)


def _is_list_of_str(value: object) -> bool:
    return isinstance(value, (list, tuple)) and len(value) > 0 and all(isinstance(v, str) for v in value)
