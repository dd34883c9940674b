"""Lightning's Trainer features under every layout, against Lightning's own ``DDPStrategy`` on the same processes.

One small module (``FeatureModule``: an input layer, four residual MLP blocks, a head; validation, test and predict
steps; its samples carry their index) trains a few epochs in each *run*, which exercises several features at once
(``conformance.FEATURES`` names each feature's run, ``conformance.FEATURE_CELLS`` what each layout must do). Both
sides see the same global batches: ``GLOBAL_BATCH // dp`` samples per data-parallel rank here, ``GLOBAL_BATCH //
world`` per DDP rank, drawn from the same ``DistributedSampler`` permutation. Compared: everything the loggers got
(per-step and per-epoch values, learning rates), callback outcomes (best checkpoint, stopped epoch), what
``validate``/``test``/``predict`` returned (predictions by sample, from every rank), the weights, and what
``MyModule.load_from_checkpoint`` reads back from the checkpoints. The runs of one world size and tier train in one
job; a refusal is checked to come before the first step.
"""

from __future__ import annotations

import functools
import re
import time
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from lightning.pytorch.callbacks import (
    EarlyStopping,
    EMAWeightAveraging,
    GradientAccumulationScheduler,
    LearningRateMonitor,
    ModelCheckpoint,
    StochasticWeightAveraging,
)
from lightning.pytorch.loggers import Logger
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.tuner import Tuner
from lightning.pytorch.utilities.rank_zero import rank_zero_only
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from typing_extensions import override

from tests.helpers import conformance
from tests.helpers.conformance import DDP, FEATURE_CELLS, FEATURES, LAYOUTS, Cell
from tests.helpers.distributed import run_distributed

GLOBAL_BATCH = 16
SAMPLES = 64  # per split: 4 training steps per epoch
_TIMEOUT = timedelta(seconds=120)


# ---------------------------------------------------------------------------------------------------- the module
class Block(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, 2 * dim)
        self.fc2 = nn.Linear(2 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(F.relu(self.fc1(x)))


class Net(nn.Module):
    def __init__(self, features: int = 8, dim: int = 16, blocks: int = 4, classes: int = 4) -> None:
        super().__init__()
        self.inp = nn.Linear(features, dim)
        self.blocks = nn.ModuleList(Block(dim) for _ in range(blocks))
        self.head = nn.Linear(dim, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


class FeatureModule(L.LightningModule):
    def __init__(self, lr: float = 0.05, schedule: str = "step", optimizers: int = 1) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = Net()
        self.gathered_ids: list[list[int]] = []

    @override
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    @override
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y, _ = batch
        loss = F.cross_entropy(self(x), y)
        self.log("train_loss", loss, on_step=True, on_epoch=True, sync_dist=True)
        return loss

    @override
    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y, index = batch
        loss = F.cross_entropy(self(x), y)
        self.log("val_loss", loss, on_epoch=True, sync_dist=True)
        self.log("val_gathered_mean", self.all_gather(loss).mean(), on_epoch=True)
        self.gathered_ids.append(sorted(self.all_gather(index).flatten().tolist()))

    @override
    def test_step(self, batch: Any, batch_idx: int) -> None:
        x, y, _ = batch
        self.log("test_loss", F.cross_entropy(self(x), y), sync_dist=True)

    @override
    def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, _, index = batch
        return torch.cat([index[:, None].float(), self(x)], dim=1)

    @override
    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.SGD(self.parameters(), lr=self.hparams.lr, momentum=0.9)
        if self.hparams.optimizers == 2:
            return [optimizer, torch.optim.SGD(self.parameters(), lr=self.hparams.lr)]
        if self.hparams.schedule == "plateau":
            scheduler = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, factor=0.5, patience=0, threshold=0.05)
            return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "monitor": "val_loss"}}
        return [optimizer], [torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.7)]


class FeatureData(L.LightningDataModule):
    """``(x, y, index)`` samples, fixed by a private generator: the same in every process."""

    def __init__(self, batch_size: int) -> None:
        super().__init__()
        self.batch_size = batch_size
        g = torch.Generator().manual_seed(7)
        x, y = torch.randn(4 * SAMPLES, 8, generator=g), torch.randint(0, 4, (4 * SAMPLES,), generator=g)
        index = torch.arange(4 * SAMPLES)
        self.splits = [TensorDataset(*(t[i * SAMPLES : (i + 1) * SAMPLES] for t in (x, y, index))) for i in range(4)]

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.splits[0], batch_size=self.batch_size, shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.splits[1], batch_size=self.batch_size)

    def test_dataloader(self) -> DataLoader:
        return DataLoader(self.splits[2], batch_size=self.batch_size)

    def predict_dataloader(self) -> DataLoader:
        return DataLoader(self.splits[3], batch_size=self.batch_size)


class MemoryLogger(Logger):
    """What the loggers receive, kept in memory (global rank 0 logs, as Lightning's loggers do)."""

    def __init__(self) -> None:
        super().__init__()
        self.history: list[tuple[int, dict[str, float]]] = []

    @property
    @override
    def name(self) -> str:
        return "memory"

    @property
    @override
    def version(self) -> int:
        return 0

    @rank_zero_only
    @override
    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        self.history.append((-1 if step is None else step, {k: float(v) for k, v in sorted(metrics.items())}))

    @override
    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        pass


class StepCounter(L.Callback):
    """Training steps started (a refusal must come before the first)."""

    def __init__(self) -> None:
        self.steps = 0

    @override
    def on_train_batch_start(self, *args: Any) -> None:
        self.steps += 1


class LrRecorder(L.Callback):
    """The first optimizer's learning rate at each epoch's end (before the epoch's scheduler update)."""

    def __init__(self) -> None:
        self.lrs: list[float] = []

    @override
    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.lrs.append(float(trainer.optimizers[0].param_groups[0]["lr"]))


# ------------------------------------------------------------------------------------------------------- runs
def _strategy(layout: str) -> Any:
    from lightning_mgpu import HybridStrategy

    if layout == DDP:
        return DDPStrategy(timeout=_TIMEOUT)
    return HybridStrategy(timeout=_TIMEOUT, **LAYOUTS[layout].kwargs)


def _batch(layout: str, world: int) -> int:
    return GLOBAL_BATCH // (world if layout == DDP else LAYOUTS[layout].dp)


def _trainer(layout: str, world: int, **kwargs: Any) -> L.Trainer:
    defaults: dict[str, Any] = {
        "accelerator": "cpu",
        "devices": world,
        "strategy": _strategy(layout),
        "max_epochs": 2,
        "logger": False,
        "enable_checkpointing": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "num_sanity_val_steps": 0,
    }
    return L.Trainer(**{**defaults, **kwargs})


def _weights(module: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def _on_rank_zero(fn: Any) -> Any:
    return fn() if dist.get_rank() == 0 else None


def _evaluate(layout: str, world: int, tmp: Path) -> dict[str, Any]:
    """Fit 3 epochs (validating each) with ModelCheckpoint(top 2) and LearningRateMonitor; test the best; validate,
    predict; save and read the checkpoint back with load_from_checkpoint."""
    module, data, logger = FeatureModule(), FeatureData(_batch(layout, world)), MemoryLogger()
    best = ModelCheckpoint(dirpath=tmp / "best", monitor="val_loss", save_top_k=2, filename="{epoch}")
    callbacks = [best, LearningRateMonitor(logging_interval="step")]
    trainer = _trainer(
        layout, world, max_epochs=3, callbacks=callbacks, logger=logger, enable_checkpointing=True, log_every_n_steps=1
    )
    trainer.fit(module, data)
    out: dict[str, Any] = {"fit_log": logger.history, "gathered_ids": module.gathered_ids}
    out["best"] = {
        "path": Path(best.best_model_path).name,
        "score": float(best.best_model_score),
        "kept": sorted(Path(p).name for p in best.best_k_models),
    }
    out["test_best"] = trainer.test(ckpt_path="best", datamodule=data, verbose=False)
    out["validate"] = trainer.validate(module, datamodule=data, verbose=False)
    out["predictions"] = torch.cat(trainer.predict(module, datamodule=data))
    saved = tmp / "saved.ckpt"
    trainer.save_checkpoint(saved)
    out["weights"] = _weights(module)
    out["loaded"] = _on_rank_zero(lambda: _weights(FeatureModule.load_from_checkpoint(saved)))
    return out


def _schedules(layout: str, world: int, tmp: Path) -> dict[str, Any]:
    """ReduceLROnPlateau on val_loss, norm clipping, an accumulation schedule and EarlyStopping, together."""
    module, data = FeatureModule(schedule="plateau"), FeatureData(_batch(layout, world))
    logger, lrs = MemoryLogger(), LrRecorder()
    stopping = EarlyStopping(monitor="val_loss", patience=1, min_delta=0.02)
    callbacks = [GradientAccumulationScheduler({1: 2}), stopping, lrs]
    trainer = _trainer(layout, world, max_epochs=6, gradient_clip_val=0.1, callbacks=callbacks, logger=logger)
    trainer.fit(module, data)
    return {
        "fit_log": logger.history,
        "lrs": [*lrs.lrs, float(trainer.optimizers[0].param_groups[0]["lr"])],  # each epoch's, and the last update
        "stopped_epoch": stopping.stopped_epoch,
        "weights": _weights(module),
    }


def _clip_value(layout: str, world: int, tmp: Path) -> dict[str, Any]:
    module, data, logger = FeatureModule(), FeatureData(_batch(layout, world)), MemoryLogger()
    trainer = _trainer(
        layout, world, gradient_clip_val=0.01, gradient_clip_algorithm="value", accumulate_grad_batches=2, logger=logger
    )
    trainer.fit(module, data)
    return {"fit_log": logger.history, "weights": _weights(module)}


def _refused_or(fit: Any) -> Any:
    """``fit(counter)``'s result, or the refusal it raised and the steps started before it."""
    counter = StepCounter()
    try:
        return fit(counter)
    except Exception as error:
        return {"error": f"{type(error).__name__}: {error}", "steps_before": counter.steps}


def _swa(layout: str, world: int, tmp: Path) -> dict[str, Any]:
    def fit(counter: StepCounter) -> dict[str, Any]:
        module, data, logger = FeatureModule(), FeatureData(_batch(layout, world)), MemoryLogger()
        swa = StochasticWeightAveraging(swa_lrs=0.02, swa_epoch_start=2)
        trainer = _trainer(layout, world, max_epochs=3, callbacks=[swa, counter], logger=logger)
        trainer.fit(module, data)
        return {"fit_log": logger.history, "weights": _weights(module)}

    return _refused_or(fit)


def _ema(layout: str, world: int, tmp: Path) -> dict[str, Any]:
    """EMA over 2 epochs, checkpointed each epoch: what load_from_checkpoint reads (the averaged weights, as the
    callback puts them, and the current ones beside), then a resume from epoch 0's checkpoint."""

    def fit(counter: StepCounter) -> dict[str, Any]:
        module, data, logger = FeatureModule(), FeatureData(_batch(layout, world)), MemoryLogger()
        every = ModelCheckpoint(dirpath=tmp / "ema", save_top_k=-1, every_n_epochs=1, filename="{epoch}")
        callbacks = [EMAWeightAveraging(decay=0.5), every, counter]
        trainer = _trainer(layout, world, callbacks=callbacks, logger=logger, enable_checkpointing=True)
        trainer.fit(module, data)
        first = tmp / "ema" / "epoch=0.ckpt"
        out = {"fit_log": logger.history, "weights": _weights(module)}
        out["loaded"] = _on_rank_zero(lambda: _weights(FeatureModule.load_from_checkpoint(first)))
        out["current"] = _on_rank_zero(lambda: torch.load(first, weights_only=True)["current_model_state"])
        resumed, resumed_logger = FeatureModule(), MemoryLogger()
        trainer = _trainer(layout, world, callbacks=[EMAWeightAveraging(decay=0.5)], logger=resumed_logger)
        trainer.fit(resumed, data, ckpt_path=first)
        out["resumed_log"], out["resumed"] = resumed_logger.history, _weights(resumed)
        return out

    return _refused_or(fit)


def _lr_find(layout: str, world: int, tmp: Path) -> dict[str, Any]:
    module, data = FeatureModule(), FeatureData(_batch(layout, world))
    trainer = _trainer(layout, world, default_root_dir=tmp)
    found = Tuner(trainer).lr_find(module, datamodule=data, min_lr=1e-3, max_lr=1.0, num_training=8)
    assert found is not None
    return {"lrs": found.results["lr"], "losses": found.results["loss"], "weights": _weights(module)}


def _scale_batch_size(layout: str, world: int, tmp: Path) -> dict[str, Any]:
    trainer = _trainer(layout, world)
    return _refused_or(lambda counter: Tuner(trainer).scale_batch_size(FeatureModule(), datamodule=FeatureData(4)))


def _several_optimizers(layout: str, world: int, tmp: Path) -> dict[str, Any]:
    def fit(counter: StepCounter) -> None:
        _trainer(layout, world, callbacks=[counter]).fit(FeatureModule(optimizers=2), FeatureData(4))

    return _refused_or(fit)


RUNS = {
    "evaluate": _evaluate,
    "schedules": _schedules,
    "clip_value": _clip_value,
    "swa": _swa,
    "ema": _ema,
    "lr_find": _lr_find,
    "scale_batch_size": _scale_batch_size,
    "several_optimizers": _several_optimizers,
}
_RUN_OF = {subject.key: subject.run for subject in FEATURES}


def _worker(jobs: list[tuple[str, str]], world: int, root: str) -> dict[tuple[str, str], Any]:
    out: dict[tuple[str, str], Any] = {}
    for run, layout in jobs:
        L.seed_everything(1234, verbose=False)
        tmp = Path(root) / f"{run}-{layout}".replace(" ", "_")
        start = time.perf_counter()
        try:
            out[run, layout] = RUNS[run](layout, world, tmp)
        except Exception:
            out[run, layout] = {"failed": traceback.format_exc()}
        if dist.get_rank() == 0:
            print(f"run {run} under {layout}: {time.perf_counter() - start:.1f} s", flush=True)
    return out


@functools.cache
def _job(world: int, slow: bool, root: str) -> dict[tuple[str, str], list[Any]]:
    """Every run the tier's cells of this world size read, and their DDP references, in one job: per run, every
    rank's result."""
    tier = [c for c in FEATURE_CELLS if c.slow == slow and LAYOUTS[c.layout].world == world]
    jobs = sorted({(_RUN_OF[c.subject], layout) for c in tier for layout in (c.layout, DDP)})
    if not jobs:
        return {}
    directory = Path(root) / f"{world}-{'slow' if slow else 'quick'}"  # each job its own checkpoints
    per_rank = run_distributed(_worker, world, jobs, world, str(directory), timeout=900)
    return {key: [rank[key] for rank in per_rank] for key in jobs}


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(tmp_path_factory.mktemp("features"))


def _results(cell: Cell, root: str) -> tuple[list[Any], list[Any]]:
    """Every rank's result of the cell's run under its layout, and under DDP."""
    world = LAYOUTS[cell.layout].world
    job = _job(world, cell.slow, root)
    run = _RUN_OF[cell.subject]
    ours, reference = job[run, cell.layout], job[run, DDP]
    for side, results in (("ours", ours), ("DDP", reference)):
        failed = [r["failed"] for r in results if isinstance(r, dict) and "failed" in r]
        if failed:
            raise AssertionError(f"the {side} run of {run!r} failed:\n{failed[0]}")
    return ours, reference


# ------------------------------------------------------------------------------------------------------ checks
def _predictions_by_sample(per_rank: list[Any]) -> dict[int, torch.Tensor]:
    """Every rank's predictions by sample index; ranks holding the same samples (tp, pp peers) must agree."""
    found: dict[int, torch.Tensor] = {}
    for result in per_rank:
        for row in result["predictions"]:
            index = int(row[0])
            if index in found:
                torch.testing.assert_close(row[1:], found[index], rtol=0, atol=0)
            found[index] = row[1:]
    return found


def _check_evaluate(subject: str, ours: list[Any], ref: list[Any]) -> str:
    mine, theirs = ours[0], ref[0]
    if subject in ("evaluate", "log", "lr_monitor"):
        conformance.assert_close_tree(mine["fit_log"], theirs["fit_log"], what="logged")
    if subject == "lr_monitor":
        assert any("lr-SGD" in metrics for _, metrics in theirs["fit_log"])
    if subject == "evaluate":
        conformance.assert_close_tree(mine["validate"], theirs["validate"], what="validate")
        predictions, expected = _predictions_by_sample(ours), _predictions_by_sample(ref)
        assert sorted(predictions) == sorted(expected) == list(range(3 * SAMPLES, 4 * SAMPLES))
        conformance.assert_close_tree(predictions, expected, atol=conformance.PREDICTION_ATOL, what="predictions")
        assert all(len(r["predictions"]) > 0 for r in ours)  # every rank gets predictions back, as under DDP
        return f"predictions {conformance.worst_absolute(predictions, expected):.1e} absolute"
    if subject == "all_gather":
        # The samples every data-parallel rank held, gathered by the step on the rank that ran it: under pipeline
        # parallelism the last stage runs the step's code per microbatch, so the gathers are compared as a whole.
        gathered = next(r["gathered_ids"] for r in ours if r["gathered_ids"])
        assert sorted(i for ids in gathered for i in ids) == sorted(i for ids in theirs["gathered_ids"] for i in ids)
        assert len(theirs["gathered_ids"]) == 16  # 4 validation batches in each of 3 epochs, then `validate`
    if subject == "best":
        assert mine["best"]["path"] == theirs["best"]["path"] and mine["best"]["kept"] == theirs["best"]["kept"]
        conformance.assert_close_tree(mine["best"]["score"], theirs["best"]["score"], what="best score")
        conformance.assert_close_tree(mine["test_best"], theirs["test_best"], what="test(ckpt_path='best')")
        return f"test {conformance.worst_relative(mine['test_best'], theirs['test_best']):.1e}"
    if subject == "load_from_checkpoint":
        conformance.assert_same_weights(mine["loaded"], theirs["loaded"])
        conformance.assert_close_tree(mine["loaded"], mine["weights"], rtol=0.0, what="loaded")  # exactly, as saved
    conformance.assert_same_weights(mine["weights"], theirs["weights"])
    return f"logged {conformance.worst_relative(mine['fit_log'], theirs['fit_log']):.1e}"


def _check_trained(subject: str, ours: list[Any], ref: list[Any]) -> str:
    mine, theirs = ours[0], ref[0]
    assert "error" not in mine, mine
    conformance.assert_close_tree(mine["fit_log"], theirs["fit_log"], what="logged")
    if subject == "plateau":
        assert theirs["lrs"][-1] < theirs["lrs"][0]  # the plateau schedule did reduce the rate
        conformance.assert_close_tree(mine["lrs"], theirs["lrs"], what="lrs")
    if subject == "early_stopping":
        assert 0 < theirs["stopped_epoch"] < 5, theirs["stopped_epoch"]  # stopped before max_epochs
        assert mine["stopped_epoch"] == theirs["stopped_epoch"]
    if subject == "ema":
        for key in ("loaded", "current", "resumed"):
            conformance.assert_same_weights(mine[key], theirs[key])
        conformance.assert_close_tree(mine["resumed_log"], theirs["resumed_log"], what="resumed")
    conformance.assert_same_weights(mine["weights"], theirs["weights"])
    worst = conformance.worst_relative(mine["fit_log"], theirs["fit_log"])
    return f"logged {worst:.1e}, weights {conformance.worst_absolute(mine['weights'], theirs['weights']):.1e} absolute"


def _check_lr_find(subject: str, ours: list[Any], ref: list[Any]) -> str:
    mine, theirs = ours[0], ref[0]
    conformance.assert_close_tree(mine["lrs"], theirs["lrs"], what="lrs")
    conformance.assert_close_tree(mine["losses"], theirs["losses"], what="losses")
    conformance.assert_same_weights(mine["weights"], theirs["weights"], atol=0.0)  # restored to the initial weights
    return f"losses {conformance.worst_relative(mine['losses'], theirs['losses']):.1e}"


_CHECKS = {
    "evaluate": _check_evaluate,
    "schedules": _check_trained,
    "clip_value": _check_trained,
    "swa": _check_trained,
    "ema": _check_trained,
    "lr_find": _check_lr_find,
}


def _check_refused(cell: Cell, ours: list[Any], ref: list[Any]) -> str:
    for result in ours:
        assert "error" in result, f"{cell.subject} under {cell.layout} was not refused"
        assert re.search(cell.match, result["error"]), result["error"]
        assert result["steps_before"] == 0, "refused after training started"
    if cell.expect == "lightning":  # Lightning refuses it under DDP too, with the same message
        assert [r["error"] for r in ref] == [r["error"] for r in ours]
    return ours[0]["error"][:100]


@pytest.mark.parametrize("cell", conformance.params(FEATURE_CELLS))
def test_feature_under_layout(cell: Cell, root: str) -> None:
    ours, reference = _results(cell, root)
    check = _CHECKS.get(_RUN_OF[cell.subject], _check_trained)
    if cell.expect in ("refused", "lightning"):
        measured = _check_refused(cell, ours, reference)
    elif cell.expect == "differs":  # by construction (the cell's note): the difference is asserted
        with pytest.raises(AssertionError) as difference:
            check(cell.subject, ours, reference)
        measured = str(difference.value).splitlines()[0][:120]
    else:
        measured = check(cell.subject, ours, reference)
    print(f"\n{cell.subject} under {cell.layout}: {cell.expect}; {measured}")
