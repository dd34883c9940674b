"""Train one LightningModule single-process and under a layout, and compare what a user would see.

The reference is plain Lightning on one CPU process (no lightning-mgpu involved) with the same seed, data and
global batches. The distributed run's per-rank batch is the global batch divided by the data-parallel size.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Callable, Optional

import lightning as L
from lightning.pytorch.strategies import DDPStrategy
import torch

from tests.helpers.distributed import run_distributed

LOSS_RTOL = 1e-5
WEIGHT_RTOL = 1e-4
WEIGHT_ATOL = 1e-5  # AdamW turns reduction-order noise on near-zero gradients into ~1e-6 steps


class LossRecorder(L.Callback):
    """Records the logged ``train_loss`` after every optimizer step, as global rank 0's loggers see it."""

    def __init__(self, key: str = "train_loss") -> None:
        self.key = key
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        self.losses.append(float(trainer.callback_metrics[self.key]))


@dataclass
class RunResult:
    losses: list[float]
    state_dict: dict[str, torch.Tensor]
    extra: dict[str, Any] = field(default_factory=dict)


def _fit_worker(
    module_factory: Callable[[], L.LightningModule],
    datamodule_factory: Callable[[], L.LightningDataModule],
    strategy_kwargs: Optional[dict[str, Any]],
    devices: int,
    max_steps: int,
    seed: int,
    trainer_kwargs: dict[str, Any],
    callbacks_factory: Optional[Callable[[], list[L.Callback]]],
    fit_kwargs: Optional[dict[str, Any]] = None,
    after_fit: Optional[Callable[[L.Trainer], Any]] = None,
) -> dict[str, Any]:
    """One fit in this process (a rank of a ``run_distributed`` job); ``after_fit(trainer)`` runs once it returned."""
    from lightning_mgpu import HybridStrategy

    L.seed_everything(seed, verbose=False)
    module = module_factory()
    datamodule = datamodule_factory()
    recorder = LossRecorder()
    extra_callbacks = callbacks_factory() if callbacks_factory else []
    if strategy_kwargs is None:
        # Plain Lightning DDP on one process: numerically a single-device run, and it draws the training order
        # from the same DistributedSampler(shuffle=True, seed) permutation as a multi-process run, whose ranks then
        # together see exactly the reference's global batches.
        strategy: Any = DDPStrategy(timeout=_TIMEOUT)
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
    strategy_kwargs: Optional[dict[str, Any]] = None,
    devices: int = 1,
    max_steps: int = 10,
    seed: int = 1234,
    trainer_kwargs: Optional[dict[str, Any]] = None,
    callbacks_factory: Optional[Callable[[], list[L.Callback]]] = None,
    fit_kwargs: Optional[dict[str, Any]] = None,
) -> tuple[RunResult, list[dict[str, Any]]]:
    """Fit in ``devices`` forked processes; return global rank 0's result and every rank's extras.

    ``fit_kwargs`` go to ``trainer.fit`` (e.g. ``ckpt_path``).
    """
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
    return RunResult(rank0["losses"], rank0["state_dict"], rank0["extra"]), [o["extra"] for o in outputs]


def assert_same_training(
    reference: RunResult,
    result: RunResult,
    loss_rtol: float = LOSS_RTOL,
    weight_rtol: float = WEIGHT_RTOL,
    weight_atol: float = WEIGHT_ATOL,
) -> None:
    """Per-step losses and final weights equal within tolerance; keys must match exactly."""
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
            result.state_dict[key].float(), expected.float(), rtol=weight_rtol, atol=weight_atol, msg=lambda m: f"{key}: {m}"
        )
