"""``_compat.lightning.RepeatedLog`` logs what ``LightningModule.log`` logs, at every step, epoch and hook.

One process, no spawn: the same module trains twice, logging through ``self.log`` and through ``RepeatedLog``;
what Lightning shows (``callback_metrics``, ``logged_metrics``, the progress bar's metrics) after every training
batch, training epoch and validation must be equal, across a ragged last batch (batch-size weighted means) and an
epoch boundary (the collection's reset).
"""

from __future__ import annotations

from typing import ClassVar

import lightning as L
import pytest
import torch
from lightning.fabric.utilities.exceptions import MisconfigurationException
from torch import nn

from lightning_mgpu._compat.lightning import RepeatedLog

# name -> options: what a step logs; values differ per step (a function of the batch).
_OPTIONS = {
    "loss": {"prog_bar": True, "sync_dist": True},
    "epoch_mean": {"on_step": False, "on_epoch": True},
    "both_max": {"on_step": True, "on_epoch": True, "reduce_fx": "max"},
    "weighted": {"on_step": False, "on_epoch": True, "batch_size": 3},
}


class _Logging(L.LightningModule):
    def __init__(self, repeated: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layer = nn.Linear(4, 1)
        self.repeated = RepeatedLog() if repeated else None
        self.full_calls = 0
        self.calls = 0

    def log(self, *args, **kwargs):  # counts the full calls RepeatedLog makes
        self.full_calls += 1
        super().log(*args, **kwargs)

    def _log(self, name, value, options):
        self.calls += 1
        if self.repeated is None:
            super().log(name, value, **options)
        else:
            self.repeated.log(self, name, value, options)

    def training_step(self, batch, batch_idx):
        (x,) = batch
        loss = self.layer(x).pow(2).mean()
        for k, (name, options) in enumerate(_OPTIONS.items()):
            self._log(name, loss.detach() * (k + 1) + x.size(0), options)
        return loss

    def validation_step(self, batch, batch_idx):
        (x,) = batch
        self._log("val", self.layer(x).mean() + x.size(0), {"prog_bar": True})

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


class _Shown(L.Callback):
    def __init__(self) -> None:
        self.shown: list = []

    def _read(self, trainer, when) -> None:
        read = lambda metrics: {k: float(v) for k, v in sorted(metrics.items())}
        self.shown.append(
            (when, read(trainer.callback_metrics), read(trainer.logged_metrics), read(trainer.progress_bar_metrics))
        )

    def on_train_batch_end(self, trainer, *args) -> None:
        self._read(trainer, "batch")

    def on_train_epoch_end(self, trainer, *args) -> None:
        self._read(trainer, "epoch")

    def on_validation_end(self, trainer, *args) -> None:
        self._read(trainer, "validation")


def _loader() -> torch.utils.data.DataLoader:
    data = torch.utils.data.TensorDataset(torch.randn(10, 4, generator=torch.Generator().manual_seed(1)))
    return torch.utils.data.DataLoader(data, batch_size=4)  # 4, 4, 2: a ragged last batch


def _trainer(tmp_path, repeated: bool, shown: _Shown, **options) -> L.Trainer:
    return L.Trainer(
        accelerator="cpu",
        max_epochs=2,
        logger=L.pytorch.loggers.CSVLogger(tmp_path / str(repeated)),
        log_every_n_steps=1,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[shown],
        **options,
    )


def _run(tmp_path, repeated: bool):
    module, shown = _Logging(repeated), _Shown()
    _trainer(tmp_path, repeated, shown).fit(module, _loader(), _loader())
    return module, shown.shown


def test_repeated_logs_show_what_self_log_shows(tmp_path):
    plain, expected = _run(tmp_path, repeated=False)
    repeated, got = _run(tmp_path, repeated=True)
    assert got == expected
    assert len(expected) == 1 + 2 * (3 + 1 + 1)  # the sanity check; per epoch: 3 batches, the epoch end, validation
    # 2 sanity validation steps, then per epoch 3 training steps logging every name, 3 validation steps.
    assert repeated.calls == plain.calls == 2 + 2 * (3 * len(_OPTIONS) + 3)
    # The fast path was taken: a full call only where a name is first logged in a hook (the sanity check and later
    # validations share one collection; the last full call is epoch 1's first `loss`, after the epoch's reset).
    assert repeated.full_calls == 1 + len(_OPTIONS) + 1, repeated.full_calls


def test_changed_options_take_lightnings_own_path_and_error(tmp_path):
    class _Changing(_Logging):
        def training_step(self, batch, batch_idx):
            (x,) = batch
            self._log("loss", x.sum(), {"prog_bar": batch_idx == 0})
            return self.layer(x).sum()

    trainer = L.Trainer(accelerator="cpu", max_steps=2, logger=False, enable_checkpointing=False)
    with pytest.raises(MisconfigurationException, match="twice in `training_step` with different arguments"):
        data = torch.utils.data.TensorDataset(torch.ones(8, 4))
        trainer.fit(_Changing(repeated=True), torch.utils.data.DataLoader(data, batch_size=4))


class _TwoLoaders(_Logging):
    """Validation over two dataloaders: one name per dataloader (`val/dataloader_idx_{0,1}`) unless told not to."""

    options: ClassVar[dict] = {"prog_bar": True}

    def validation_step(self, batch, batch_idx, dataloader_idx=0):
        (x,) = batch
        self._log("val", self.layer(x).mean() + 10 * dataloader_idx, self.options)
        self._log("count", torch.tensor(x.size(0)), {"reduce_fx": "sum"})  # an int tensor

    def test_step(self, batch, batch_idx, dataloader_idx=0):
        self.validation_step(batch, batch_idx, dataloader_idx)


def _run_two_loaders(tmp_path, repeated: bool, module_class=_TwoLoaders):
    module, shown = module_class(repeated), _Shown()
    # Validation mid-epoch (then training resumes in the same collection), with gradient accumulation.
    trainer = _trainer(tmp_path, repeated, shown, val_check_interval=2, accumulate_grad_batches=2)
    trainer.fit(module, _loader(), [_loader(), _loader()])
    validated = trainer.validate(module, [_loader(), _loader()], verbose=False)
    tested = trainer.test(module, _loader(), verbose=False)
    csv = next((tmp_path / str(repeated)).rglob("metrics.csv")).read_text()
    return shown.shown, (validated, tested), csv


def test_two_validation_dataloaders_mid_epoch_validation_and_validate_test_after_fit(tmp_path):
    expected, got = _run_two_loaders(tmp_path, False), _run_two_loaders(tmp_path, True)
    assert any("val/dataloader_idx_1" in metrics for _, metrics, _, _ in expected[0])  # the case is exercised
    assert got == expected


def test_add_dataloader_idx_false_with_one_name_for_two_dataloaders_raises_as_self_log(tmp_path):
    class _OneName(_TwoLoaders):
        options: ClassVar[dict] = {"add_dataloader_idx": False}

    for repeated in (False, True):
        with pytest.raises(MisconfigurationException, match="twice in `validation_step` with different arguments"):
            _run_two_loaders(tmp_path, repeated, _OneName)
