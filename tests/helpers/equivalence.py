"""Train one LightningModule single-process and under a layout, and compare what a user would see.

The reference is plain Lightning on one CPU process (no lightning-mgpu involved) with the same seed, data and
global batches. The distributed run's per-rank batch is the global batch divided by the data-parallel size.
"""

from __future__ import annotations

import copy
import functools
import hashlib
import types
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import lightning as L
import torch
from lightning.pytorch.strategies import DDPStrategy

from tests.helpers.distributed import run_distributed

LOSS_RTOL = 1e-5
WEIGHT_RTOL = 1e-4
WEIGHT_ATOL = 1e-5  # AdamW turns reduction-order noise on near-zero gradients into ~1e-6 steps
# ``strategy_kwargs`` for the one-process reference of a module whose loss leaves parameters unused (a DQN's target
# network), which Lightning's DDP refuses without ``find_unused_parameters=True``.
FIND_UNUSED = "find unused parameters"


class LightningDDP(dict):
    """Strategy arguments that select Lightning's own ``DDPStrategy`` (with these arguments) instead of
    ``HybridStrategy``: the reference on the same number of processes, e.g.
    ``LightningDDP(find_unused_parameters=True)``."""


class LossRecorder(L.Callback):
    """Records the logged ``train_loss`` after every optimizer step, as global rank 0's loggers see it (nothing for a
    module that logs no such key: ``assert_same_training`` then fails on the empty list, the GAN tests record their
    own keys)."""

    def __init__(self, key: str = "train_loss") -> None:
        self.key = key
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        if self.key in trainer.callback_metrics:
            self.losses.append(float(trainer.callback_metrics[self.key]))


@dataclass
class RunResult:
    losses: list[float]
    state_dict: dict[str, torch.Tensor]
    extra: dict[str, Any] = field(default_factory=dict)


def _fit_worker(
    module_factory: Callable[[], L.LightningModule],
    datamodule_factory: Callable[[], L.LightningDataModule],
    strategy_kwargs: dict[str, Any] | None,
    devices: int,
    max_steps: int,
    seed: int,
    trainer_kwargs: dict[str, Any],
    callbacks_factory: Callable[[], list[L.Callback]] | None,
    fit_kwargs: dict[str, Any] | None = None,
    after_fit: Callable[[L.Trainer], Any] | None = None,
    before_fit: Callable[[L.Trainer, L.LightningModule, L.LightningDataModule], Any] | None = None,
) -> dict[str, Any]:
    """One fit in this process (a rank of a ``run_distributed`` job); ``before_fit(trainer, module, datamodule)``
    runs before it (``trainer.validate``), ``after_fit(trainer)`` once it returned."""
    from lightning_mgpu import HybridStrategy

    L.seed_everything(seed, verbose=False)
    module = module_factory()
    datamodule = datamodule_factory()
    recorder = LossRecorder()
    extra_callbacks = callbacks_factory() if callbacks_factory else []
    if isinstance(strategy_kwargs, LightningDDP):
        strategy: Any = DDPStrategy(timeout=_TIMEOUT, **strategy_kwargs)
    elif strategy_kwargs is None:
        # Plain Lightning DDP on one process: numerically a single-device run, and it draws the training order
        # from the same DistributedSampler(shuffle=True, seed) permutation as a multi-process run, whose ranks then
        # together see exactly the reference's global batches.
        strategy = DDPStrategy(timeout=_TIMEOUT)
    elif strategy_kwargs == FIND_UNUSED:
        strategy = DDPStrategy(timeout=_TIMEOUT, find_unused_parameters=True)
    else:
        strategy = HybridStrategy(timeout=_TIMEOUT, **strategy_kwargs)
    defaults: dict[str, Any] = {
        "logger": False,
        "enable_checkpointing": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "num_sanity_val_steps": 0,
    }
    trainer = L.Trainer(
        accelerator="cpu",
        devices=devices,
        strategy=strategy,
        max_steps=max_steps,
        callbacks=[recorder, *extra_callbacks],
        **{**defaults, **trainer_kwargs},  # trainer_kwargs may override the defaults (e.g. enable_checkpointing)
    )
    if before_fit is not None:
        before_fit(trainer, module, datamodule)
    trainer.fit(module, datamodule, **(fit_kwargs or {}))
    if after_fit is not None:
        after_fit(trainer)
    if isinstance(trainer.strategy, HybridStrategy):
        state_dict = trainer.strategy.full_state_dict()
    else:
        state_dict = {k: v.detach().clone() for k, v in module.state_dict().items()}
    extra = {}
    for callback in extra_callbacks:
        extra.update(getattr(callback, "results", {}))
    return {"losses": recorder.losses, "state_dict": state_dict, "extra": extra, "rank": trainer.global_rank}


_TIMEOUT = timedelta(seconds=120)  # a collective that waits longer fails the run instead of hanging it


def fit(
    module_factory: Callable[[], L.LightningModule],
    datamodule_factory: Callable[[], L.LightningDataModule],
    strategy_kwargs: dict[str, Any] | None = None,
    devices: int = 1,
    max_steps: int = 10,
    seed: int = 1234,
    trainer_kwargs: dict[str, Any] | None = None,
    callbacks_factory: Callable[[], list[L.Callback]] | None = None,
    fit_kwargs: dict[str, Any] | None = None,
) -> tuple[RunResult, list[dict[str, Any]]]:
    """Fit in ``devices`` forked processes; return global rank 0's result and every rank's extras.

    ``fit_kwargs`` go to ``trainer.fit`` (e.g. ``ckpt_path``). A one-process reference (no strategy, no callbacks,
    no fit arguments) is computed once per test session for each distinct run: see ``_reference_key``.
    """
    key = None
    if strategy_kwargs is None and devices == 1 and callbacks_factory is None and not fit_kwargs:
        key = _reference_key(module_factory, datamodule_factory, max_steps, seed, trainer_kwargs or {})
        if key is not None and key in _REFERENCES:
            return copy.deepcopy(_REFERENCES[key])
    outputs = run_distributed(
        _fit_worker,
        devices,
        module_factory,
        datamodule_factory,
        strategy_kwargs,
        devices,
        max_steps,
        seed,
        trainer_kwargs or {},
        callbacks_factory,
        fit_kwargs,
    )
    rank0 = next(o for o in outputs if o["rank"] == 0)
    result = RunResult(rank0["losses"], rank0["state_dict"], rank0["extra"]), [o["extra"] for o in outputs]
    if key is not None:
        _REFERENCES[key] = copy.deepcopy(result)
    return result


# ------------------------------------------------------------------------------------ one-process reference memo
_REFERENCES: dict[tuple, tuple[RunResult, list[dict[str, Any]]]] = {}
_PLAIN = (type(None), bool, int, float, complex, str, bytes)


class _Undescribable(Exception):
    """A value whose behaviour a key cannot pin down: that run is not memoized."""


def _reference_key(*parts: Any) -> tuple | None:
    """A key that is equal for two runs only if they compute the same thing, else None (then no memo).

    Functions are described by what they compute: their code (bytecode, constants, names, nested code) and the
    values they close over, default to, or read as module globals, so that ``lambda: data(8)`` in two test files is
    one key and ``lambda: data(4)`` another; ``functools.partial`` by its function and arguments; classes and modules
    by their qualified names; containers by their items. Anything else (a bound method, an object with state) makes
    the run unmemoized rather than risk two runs sharing a key.
    """
    try:
        return _describe(parts, set())
    except _Undescribable:
        return None


def _describe(value: Any, seen: set[int]) -> Any:
    if isinstance(value, _PLAIN):
        return (type(value).__name__, value)
    if isinstance(value, (tuple, list, frozenset, set)):
        items = [_describe(v, seen) for v in value]
        return (type(value).__name__, tuple(sorted(items, key=repr) if isinstance(value, (set, frozenset)) else items))
    if isinstance(value, dict):
        if not all(isinstance(k, str) for k in value):
            raise _Undescribable(value)
        return ("dict", tuple(sorted((k, _describe(v, seen)) for k, v in value.items())))
    if isinstance(value, functools.partial):
        return ("partial", _describe(value.func, seen), _describe(value.args, seen), _describe(value.keywords, seen))
    if isinstance(value, type):
        if "<locals>" in value.__qualname__:  # one name for classes made per call, each perhaps different
            raise _Undescribable(value)
        return ("class", value.__module__, value.__qualname__)
    if isinstance(value, types.ModuleType):
        return ("module", value.__name__)
    if isinstance(value, types.FunctionType):
        return _describe_function(value, seen)
    raise _Undescribable(value)


def _describe_function(fn: types.FunctionType, seen: set[int]) -> Any:
    name = ("function", fn.__module__, fn.__qualname__)
    if id(fn) in seen:  # recursion: the outer description already holds its code
        return name
    seen = seen | {id(fn)}
    code = fn.__code__
    digest = hashlib.sha256(repr(_code_parts(code)).encode()).hexdigest()
    cells = tuple(_describe(cell.cell_contents, seen) for cell in fn.__closure__ or ())
    read_globals = tuple(
        (n, _describe(fn.__globals__[n], seen)) for n in sorted(_global_names(code)) if n in fn.__globals__
    )
    return (
        "function",
        digest,
        _describe(fn.__defaults__, seen),
        _describe(fn.__kwdefaults__, seen),
        cells,
        read_globals,
    )


def _code_parts(code: types.CodeType) -> tuple:
    consts = tuple(_code_parts(c) if isinstance(c, types.CodeType) else repr(c) for c in code.co_consts)
    return code.co_code, consts, code.co_names


def _global_names(code: types.CodeType) -> set[str]:
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _global_names(const)
    return names


def assert_same_training(
    reference: RunResult,
    result: RunResult,
    loss_rtol: float = LOSS_RTOL,
    weight_rtol: float = WEIGHT_RTOL,
    weight_atol: float = WEIGHT_ATOL,
    weight_atols: dict[str, float] | None = None,
) -> None:
    """Per-step losses and final weights equal within tolerance; keys must match exactly. ``weight_atols``: a
    tensor's own absolute tolerance, where it differs from ``weight_atol``."""
    assert len(result.losses) == len(reference.losses) > 0, (len(result.losses), len(reference.losses))
    torch.testing.assert_close(
        torch.tensor(result.losses, dtype=torch.float64),
        torch.tensor(reference.losses, dtype=torch.float64),
        rtol=loss_rtol,
        atol=0.0,
        msg=lambda m: f"per-step losses differ:\n{m}\nref={reference.losses}\ngot={result.losses}",
    )
    assert set(result.state_dict) == set(reference.state_dict), (
        f"state_dict keys differ: missing={set(reference.state_dict) - set(result.state_dict)},"
        f" unexpected={set(result.state_dict) - set(reference.state_dict)}"
    )
    for key, expected in reference.state_dict.items():
        torch.testing.assert_close(
            result.state_dict[key].float(),
            expected.float(),
            rtol=weight_rtol,
            atol=(weight_atols or {}).get(key, weight_atol),
            msg=lambda m: f"{key}: {m}",
        )
