"""The DeepSpeed config of ``zero_backend="deepspeed"``: the user's, completed from the Trainer, checked early.

The Trainer's arguments are the single source of truth for what both backends share: precision, gradient
clipping, gradient accumulation and the micro-batch size (and ``zero_stage`` for the ZeRO stage). They are
written into the config; a ``deepspeed_config`` that says otherwise is refused, naming both values, instead of
one silently winning. Everything else in the config (offloading, bucket sizes, ZeRO++ options, ...) passes
through to ``deepspeed.initialize`` untouched.

Without a ``deepspeed_config`` the engine gets the ZeRO settings of Lightning's ``DeepSpeedStrategy(stage=N)``
(:data:`LIGHTNING_DEFAULTS`: ``overlap_comm``, 2e8-element buckets, ...), so that moving from it changes neither
the engine nor its speed. A given ``deepspeed_config`` is taken as it is, and what it leaves unset keeps
DeepSpeed's own defaults: a ``ds_config.json`` means here what it means to ``deepspeed.initialize`` -- the same
rule as Lightning's ``DeepSpeedStrategy(config=...)``.

Checks that need only the config and the strategy's arguments run when the strategy is built, before any
process starts (:func:`check_config`); those that need the Trainer run in :func:`build_config`, before
``deepspeed.initialize``.
"""

from __future__ import annotations

import copy
import difflib
import functools
import json
from collections.abc import KeysView
from pathlib import Path
from typing import Any

DeepSpeedConfig = None | dict | str | Path

# Sections the strategy owns: the optimizer and scheduler come from `configure_optimizers`.
_REFUSED_SECTIONS = {
    "optimizer": "the optimizer comes from the LightningModule's `configure_optimizers`",
    "scheduler": "the LR scheduler comes from the LightningModule's `configure_optimizers` (Lightning steps it)",
}
# What Lightning's DeepSpeedStrategy(stage=N) configures when it is given no config (lightning 2.6:
# `DeepSpeedStrategy.__init__`'s defaults, `_create_default_config`), where DeepSpeed's own defaults differ: at ZeRO
# 1/2 `overlap_comm` is off and both buckets hold 5e8 elements, `sub_group_size` is 1e9. Its `activation_checkpointing`
# and `aio` sections equal DeepSpeed's defaults and are left out.
LIGHTNING_DEFAULTS: dict[str, Any] = {
    "zero_allow_untested_optimizer": True,
    "zero_optimization": {
        "contiguous_gradients": True,
        "overlap_comm": True,
        "allgather_partitions": True,
        "reduce_scatter": True,
        "allgather_bucket_size": 200_000_000,
        "reduce_bucket_size": 200_000_000,
        "sub_group_size": 1_000_000_000_000,
    },
}
# Trainer precision -> the DeepSpeed section that is enabled for it.
_PRECISION_SECTIONS = {
    "32-true": None,
    "32": None,
    "bf16-mixed": "bf16",
    "bf16-true": "bf16",
    "16-mixed": "fp16",
    "16-true": "fp16",
}


def load_config(config: DeepSpeedConfig) -> dict[str, Any]:
    """``None``, a dict or the path of a JSON file -> a fresh dict (the user's object is never modified)."""
    if config is None:
        return {}
    if isinstance(config, (str, Path)):
        path = Path(config)
        if not path.is_file():
            raise FileNotFoundError(f"`deepspeed_config={str(config)!r}` is not a file. Pass a dict or a JSON file.")
        try:
            loaded = json.loads(path.read_text())
        except ValueError as error:
            raise ValueError(f"`deepspeed_config={str(config)!r}` is not valid JSON: {error}") from None
        if not isinstance(loaded, dict):
            raise ValueError(
                f"`deepspeed_config={str(config)!r}` must hold a JSON object, got {type(loaded).__name__}."
            )
        return loaded
    if isinstance(config, dict):
        return copy.deepcopy(config)
    raise ValueError(
        f"`deepspeed_config` must be None, a dict or the path of a JSON file, got {type(config).__name__}."
    )


def check_config(config: DeepSpeedConfig, zero_stage: int | str) -> None:
    """What can be judged from the strategy's arguments alone; raised when the strategy is built (a
    ``zero_stage="auto"`` is judged again once chosen, by :func:`build_config`)."""
    chosen = zero_stage != "auto"
    user = load_config(config)
    for section, why in _REFUSED_SECTIONS.items():
        if section in user:
            raise ValueError(
                f"`deepspeed_config` has an {section!r} section, but {why}. Remove {section!r} from deepspeed_config."
            )
    zero = user.get("zero_optimization", {})
    if not isinstance(zero, dict):
        raise ValueError(f"`deepspeed_config['zero_optimization']` must be a dict, got {zero!r}.")
    if chosen and "stage" in zero and zero["stage"] != zero_stage:
        raise ValueError(
            f"`deepspeed_config` sets zero_optimization.stage={zero['stage']!r} but HybridStrategy has"
            f" zero_stage={zero_stage}. Set HybridStrategy(zero_stage={zero['stage']!r}) and remove the stage from"
            " deepspeed_config (zero_stage is the one place the stage is chosen)."
        )
    for kind in ("offload_optimizer", "offload_param"):
        offload = zero.get(kind) or {}
        if not isinstance(offload, dict):
            raise ValueError(f"`deepspeed_config['zero_optimization'][{kind!r}]` must be a dict, got {offload!r}.")
        device = offload.get("device", "none")
        if device not in ("none", "cpu", "nvme"):
            raise ValueError(
                f"`deepspeed_config` zero_optimization.{kind}.device={device!r}: use 'cpu', 'nvme' or 'none'."
            )
        if device == "nvme" and not offload.get("nvme_path"):
            raise ValueError(
                f"`deepspeed_config` offloads to NVMe (zero_optimization.{kind}.device='nvme') without a path. Add"
                f" zero_optimization.{kind}.nvme_path='/local_nvme' (a directory on a fast local disk), or use"
                " device='cpu'."
            )
        if chosen and kind == "offload_param" and device != "none" and zero_stage != 3:
            raise ValueError(
                f"`deepspeed_config` offloads parameters (zero_optimization.offload_param.device={device!r}), which"
                f" DeepSpeed does at ZeRO stage 3 only; HybridStrategy has zero_stage={zero_stage}. Set zero_stage=3"
                " or remove offload_param."
            )
    _check_zero_section(zero)
    _check_with_deepspeeds_parser(user, zero_stage if isinstance(zero_stage, int) else None)


def _check_zero_section(zero: dict[str, Any]) -> None:
    """DeepSpeed's own validation of the ZeRO section (unknown or misspelt keys, wrong types), run when the
    strategy is built instead of inside every rank's ``deepspeed.initialize``."""
    try:
        from deepspeed.runtime.zero.config import DeepSpeedZeroConfig
    except ImportError:
        return  # the engine reports the missing package when it is built
    try:
        DeepSpeedZeroConfig(**{key: value for key, value in zero.items() if key != "stage"})
    except ValueError as error:  # pydantic's ValidationError
        errors_of = getattr(error, "errors", None)
        errors = errors_of() if callable(errors_of) else []
        problems = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in errors) or str(error)
        raise ValueError(
            f"`deepspeed_config['zero_optimization']` is not valid for DeepSpeed: {problems}. Correct or remove"
            " these keys (DeepSpeed's ZeRO configuration reference lists the valid ones)."
        ) from None


# Top-level keys `deepspeed.initialize` reads itself, outside the config parser (Ulysses sequence parallelism's mesh;
# deepspeed/__init__.py), and the autotuner's section (read by DeepSpeed's launcher).
_READ_OUTSIDE_THE_PARSER = ("sequence_parallel_size", "data_parallel_size", "autotuning")
# Placeholders for the values filled from the Trainer (build_config checks the user's own against the Trainer's).
_PROBE_BATCH = {"train_batch_size": 1, "train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1}


class _ReadRecorder(dict):
    """A config dict that records which keys DeepSpeed's parser asks for (however it asks)."""

    def __init__(self, *args: object) -> None:
        super().__init__(*args)
        self.read: set[object] = set()

    def __getitem__(self, key: object) -> Any:
        self.read.add(key)
        return super().__getitem__(key)

    def __contains__(self, key: object) -> bool:
        self.read.add(key)
        return super().__contains__(key)

    def get(self, key: object, default: object = None) -> Any:
        self.read.add(key)
        return super().get(key, default)

    def keys(self) -> Any:  # a view whose `key in ...` asks this dict: recorded too
        return KeysView(self)


class _OneRank:
    """DeepSpeed's ``mpu`` for parsing a config outside a job: one data-parallel rank."""

    def get_data_parallel_world_size(self) -> int:
        return 1


def _parse(config: dict[str, Any]) -> set[object]:
    """Run DeepSpeed's own config parser (``DeepSpeedConfig``) over ``config``; the top-level keys it read."""
    from deepspeed.runtime.config import DeepSpeedConfig

    probe = _ReadRecorder(config)
    DeepSpeedConfig(probe, mpu=_OneRank())
    return probe.read


@functools.cache
def _known_keys() -> frozenset[str]:
    """Every top-level key the installed DeepSpeed reads: what its parser asks of a minimal config (sections it
    looks for, whether present or not), plus the few read outside the parser."""
    return frozenset(k for k in _parse(dict(_PROBE_BATCH)) if isinstance(k, str)) | set(_READ_OUTSIDE_THE_PARSER)


def _check_with_deepspeeds_parser(user: dict[str, Any], zero_stage: int | None) -> None:
    """DeepSpeed's parser over the user's config, before any process starts: its own errors surface here, and a
    top-level key it never reads (``"zero_optimisation"``, which DeepSpeed would silently ignore) is refused,
    naming the closest key DeepSpeed knows."""
    try:
        from deepspeed.runtime.config import DeepSpeedConfigError
    except ImportError:
        return  # the engine reports the missing package when it is built
    probe = {key: value for key, value in user.items() if key not in _PROBE_BATCH} | _PROBE_BATCH
    if zero_stage is not None:
        probe["zero_optimization"] = {**probe.get("zero_optimization", {}), "stage": zero_stage}
    try:
        read = _parse(probe)
    except (DeepSpeedConfigError, ValueError, TypeError, KeyError, AssertionError) as error:
        raise ValueError(f"`deepspeed_config` is not valid for DeepSpeed {_deepspeed_version()}: {error}") from None
    known = _known_keys() | {k for k in read if isinstance(k, str)}
    for key in user:
        if key in known:
            continue
        close = difflib.get_close_matches(str(key), sorted(known), n=1, cutoff=0.6)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise ValueError(
            f"`deepspeed_config` has the top-level key {key!r}, which DeepSpeed {_deepspeed_version()} does not"
            f" read (it would be ignored).{hint} Correct or remove it (DeepSpeed's configuration reference lists"
            " the valid keys)."
        )


def _deepspeed_version() -> str:
    import deepspeed

    return str(deepspeed.__version__)


def build_config(
    config: DeepSpeedConfig,
    zero_stage: int,
    precision: str,
    gradient_clip_val: float | None,
    gradient_clip_algorithm: str | None,
    accumulate_grad_batches: int,
    micro_batch_size: int,
    data_parallel_size: int,
) -> dict[str, Any]:
    """The config for ``deepspeed.initialize``: the user's, with the Trainer's values filled in.

    Gradient accumulation is driven by Lightning's loop: the engine is told which backward is the accumulation
    boundary (the one inside Lightning's optimizer step), so ``accumulate_grad_batches`` of any value, and an
    epoch that ends mid-window, step exactly where the torch backend steps. ``config=None`` starts from
    :data:`LIGHTNING_DEFAULTS`.
    """
    check_config(config, zero_stage)
    user = copy.deepcopy(LIGHTNING_DEFAULTS) if config is None else load_config(config)
    filled: dict[str, float | bool] = {
        "train_micro_batch_size_per_gpu": micro_batch_size,
        "gradient_accumulation_steps": accumulate_grad_batches,
        "train_batch_size": micro_batch_size * accumulate_grad_batches * data_parallel_size,
        "gradient_clipping": _clip_value(gradient_clip_val, gradient_clip_algorithm),
        "managed_gradient_accumulation": True,
    }
    trainer_args = {
        "train_micro_batch_size_per_gpu": "the train dataloader's batch_size",
        "gradient_accumulation_steps": "Trainer(accumulate_grad_batches)",
        "train_batch_size": "batch_size x accumulate_grad_batches x data_parallel_size",
        "gradient_clipping": "Trainer(gradient_clip_val)",
        "managed_gradient_accumulation": "Lightning's loop (accumulation is driven by Lightning)",
    }
    for key, value in filled.items():
        if key in user and user[key] != value:
            raise ValueError(
                f"`deepspeed_config` sets {key}={user[key]!r} but {trainer_args[key]} gives {value!r}. Remove {key!r}"
                f" from deepspeed_config; it is filled from the Trainer."
            )
        user[key] = value
    _fill_precision(user, precision)
    user.setdefault("zero_optimization", {})["stage"] = zero_stage
    user.setdefault("steps_per_print", 2**31 - 1)  # Lightning logs; DeepSpeed's own prints would interleave
    return user


def _clip_value(value: float | None, algorithm: str | None) -> float:
    if value is None or value == 0:
        return 0.0
    if algorithm not in (None, "norm"):
        raise ValueError(
            f"Trainer(gradient_clip_algorithm={algorithm!r}) is not available with zero_backend='deepspeed':"
            " DeepSpeed clips by the global norm only. Use gradient_clip_algorithm='norm' or zero_backend='torch'."
        )
    return float(value)


def _fill_precision(config: dict[str, Any], precision: str) -> None:
    if precision not in _PRECISION_SECTIONS:
        raise ValueError(
            f"Trainer(precision={precision!r}) is not available with zero_backend='deepspeed'. Use one of"
            f" {', '.join(map(repr, _PRECISION_SECTIONS))}, or zero_backend='torch'."
        )
    wanted = _PRECISION_SECTIONS[precision]
    if wanted == "fp16":
        _check_fp16_supported(precision)
    for section in ("bf16", "fp16"):
        enabled = section == wanted
        given = config.get(section, {})
        if not isinstance(given, dict):
            raise ValueError(f"`deepspeed_config[{section!r}]` must be a dict, got {given!r}.")
        if "enabled" in given and bool(given["enabled"]) != enabled:
            raise ValueError(
                f"`deepspeed_config` sets {section}.enabled={given['enabled']!r} but Trainer(precision={precision!r})"
                f" means {section}.enabled={enabled}. Remove {section}.enabled from deepspeed_config and choose the"
                " precision with Trainer(precision=...)."
            )
        config[section] = {**given, "enabled": enabled}


def _check_fp16_supported(precision: str) -> None:
    """DeepSpeed refuses fp16 on a device without fp16 kernels (a CPU whose oneDNN has none) only inside
    ``deepspeed.initialize``, with no way out named; say it here, with the alternatives."""
    from deepspeed.accelerator import get_accelerator

    accelerator = get_accelerator()
    if not accelerator.is_fp16_supported():
        raise ValueError(
            f"Trainer(precision={precision!r}) runs DeepSpeed in fp16, which DeepSpeed does not support on this"
            f" {accelerator.device_name()} device. Use precision='bf16-mixed', or zero_backend='torch' (its 16-mixed"
            " runs here)."
        )
