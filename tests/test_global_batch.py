"""``HybridStrategy(global_batch_size=N)``: the samples per optimizer step stay N whatever the data-parallel size."""

from __future__ import annotations

import functools
from typing import Any

import lightning as L
import pytest
import torch

from lightning_mgpu.layout_checks import accumulation_for
from tests.helpers.batched import Run, fit_each, references, result
from tests.helpers.modules import RandomTokenDataModule
from tests.helpers.nanogpt import NanoGPTModule

STEPS = 6
NANOGPT = functools.partial(NanoGPTModule, n_layer=2)


def _data(batch: int) -> Any:
    return functools.partial(RandomTokenDataModule, vocab_size=128, seq_len=32, batch_size=batch)


def test_accumulation_is_the_global_batch_over_the_samples_of_one_micro_step():
    assert accumulation_for(8, 2, 2, requested=1) == 2
    assert accumulation_for(64, 4, 16, requested=1) == 1
    assert accumulation_for(8, 2, 2, requested=2) == 2  # the Trainer's own setting, when it agrees
    with pytest.raises(ValueError, match=r"global_batch_size=8 is not a multiple.*3 per data-parallel rank x 2"):
        accumulation_for(8, 3, 2, requested=1)
    with pytest.raises(ValueError, match=r"accumulate_grad_batches=4\) contradicts global_batch_size=8"):
        accumulation_for(8, 2, 2, requested=4)


class Accumulation(L.Callback):
    def __init__(self) -> None:
        self.results: dict[str, Any] = {}

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.results["accumulate_grad_batches"] = trainer.accumulate_grad_batches
        self.results["optimizer_steps"] = trainer.global_step


def test_the_same_global_batch_on_2_ranks_trains_like_one_process():
    """dp 2 with 2 samples per rank and global_batch_size=8 accumulates 2 micro-batches per step: after 6 optimizer
    steps the weights are one process's with batches of 8 (1e-5 relative, 1e-4 absolute after AdamW)."""
    (reference,) = references({"one": Run(NANOGPT, _data(8), None, STEPS)}).values()
    run = Run(NANOGPT, _data(2), {"global_batch_size": 8}, STEPS, callbacks_factory=lambda: [Accumulation()])
    trained, extras = result(fit_each({"dp 2": run}, 2)["dp 2"])
    assert all(e == {"accumulate_grad_batches": 2, "optimizer_steps": STEPS} for e in extras), extras
    for key, expected in result(reference).state_dict.items():
        torch.testing.assert_close(trained.state_dict[key], expected, rtol=1e-5, atol=1e-4, msg=key)


def test_a_global_batch_the_ranks_cannot_make_is_refused_before_the_first_step():
    run = Run(NANOGPT, _data(3), {"global_batch_size": 8}, STEPS)
    outcome = fit_each({"bad": run}, 2)["bad"]
    assert isinstance(outcome, str) and "global_batch_size=8 is not a multiple" in outcome, outcome


def test_global_batch_size_must_be_a_positive_integer():
    from lightning_mgpu import HybridStrategy

    with pytest.raises(ValueError, match=r"`global_batch_size` must be a positive integer"):
        HybridStrategy(global_batch_size=0)


class SaveAfterStep(L.Callback):
    """``trainer.save_checkpoint`` once the optimizer has taken ``step`` steps (where ModelCheckpoint saves)."""

    def __init__(self, path: Any, step: int) -> None:
        self.path, self.step, self.saved = path, step, False
        self.results: dict[str, Any] = {}

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        if trainer.global_step == self.step and not self.saved:
            trainer.save_checkpoint(self.path)
            self.saved = True


@pytest.mark.parametrize(("saved_on", "resumed_on"), [(2, 1), (1, 2)], ids=["dp2-to-1", "dp1-to-2"])
def test_a_mid_epoch_resume_on_another_data_parallel_size_continues_in_samples(tmp_path, saved_on, resumed_on):
    """Saved after 3 of 6 steps (mid-epoch: 8 steps an epoch) with 4 samples per rank and global_batch_size=8, then
    resumed on the other data-parallel size with the same per-rank batch (so accumulation 1 <-> 2): the epoch goes on
    at its 25th sample, neither repeating nor skipping one, and the 6 steps end where one process with batches of 8
    does (1e-5 relative, 1e-4 absolute after AdamW). Counted in per-rank batches it would repeat or skip 12."""
    from tests.helpers.equivalence import fit

    (reference,) = references({"one": Run(NANOGPT, _data(8), None, STEPS)}).values()
    checkpoint = tmp_path / "step3.ckpt"
    strategy = {"global_batch_size": 8}
    fit(NANOGPT, _data(4), strategy, saved_on, 3, callbacks_factory=lambda: [SaveAfterStep(checkpoint, 3)])
    resumed, extras = fit(
        NANOGPT,
        _data(4),
        strategy,
        resumed_on,
        STEPS,
        callbacks_factory=lambda: [Accumulation()],
        fit_kwargs={"ckpt_path": str(checkpoint)},
    )
    assert extras[0] == {"accumulate_grad_batches": 2 // resumed_on, "optimizer_steps": STEPS}, extras
    for key, expected in result(reference).state_dict.items():
        torch.testing.assert_close(resumed.state_dict[key], expected, rtol=1e-5, atol=1e-4, msg=key)
