"""``checkpoint.resume``: the data position of a mid-epoch checkpoint, recounted for another batch step."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from lightning.pytorch.loops.progress import _BatchProgress

from lightning_mgpu.checkpoint.resume import continue_in_samples


def _trainer(batches_done: int) -> SimpleNamespace:
    progress = _BatchProgress()
    progress.increment_by(batches_done)  # every counter, this epoch's and the total
    return SimpleNamespace(fit_loop=SimpleNamespace(epoch_loop=SimpleNamespace(batch_progress=progress)))


def test_the_consumed_samples_are_recounted_in_this_runs_batches():
    trainer = _trainer(3)  # 3 steps of dp 4 x 2 samples = 24 samples
    assert continue_in_samples(trainer, 3, {"samples_per_batch": 8}, samples_per_batch=4) == 6
    progress = trainer.fit_loop.epoch_loop.batch_progress
    assert (progress.current.ready, progress.current.completed, progress.total.processed) == (6, 6, 6)


def test_the_same_batch_step_changes_nothing():
    trainer = _trainer(3)
    assert continue_in_samples(trainer, 3, {"samples_per_batch": 8}, samples_per_batch=8) == 3
    assert trainer.fit_loop.epoch_loop.batch_progress.current.completed == 3


def test_samples_the_new_batch_step_does_not_divide_are_refused_with_the_numbers():
    with pytest.raises(ValueError, match=r"stopped after 24 samples.*batch steps of 16 samples"):
        continue_in_samples(_trainer(3), 3, {"samples_per_batch": 8}, samples_per_batch=16)
