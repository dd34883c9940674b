"""Continue the data where a mid-epoch checkpoint stopped.

Lightning restores its loop counters, but a plain ``DataLoader`` is not resumable: after a mid-epoch resume it
restarts the epoch's iterator from its first batch (with a warning), so the resumed run trains on batches the
interrupted one had already seen. The strategy hands the training loader to :class:`FastForward`, which skips
the batches the checkpoint's epoch had consumed, once, using the sampler's epoch of the checkpoint.

The position is kept in samples: a checkpoint records the samples one batch step took (per-rank batch x
data-parallel size), so a job resumed on another data-parallel size (or per-rank batch) skips exactly the samples
the interrupted epoch consumed, and Lightning's batch counters of that epoch are recounted in the new batches
(:func:`continue_in_samples`). With ``global_batch_size`` the optimizer steps then take the same samples as before.

Lightning's loop counters do not always resume where the data stopped: a checkpoint saved after ``fit(max_steps=k)``
returned mid-epoch would resume at the next epoch, one saved in ``on_train_epoch_end`` an epoch too far. The
checkpointer passes every checkpoint through :func:`align_loops_with_data` when saving and loading.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from lightning.pytorch.utilities.seed import isolate_rng
from torch.utils.data import DataLoader, IterableDataset

from lightning_mgpu._compat.data import with_sampler
from lightning_mgpu._compat.lightning import set_sampler_epoch

if TYPE_CHECKING:
    import lightning.pytorch as pl


DATA_KEY = "lightning_mgpu_data"  # in a checkpoint: how many samples one batch step of the saving run took


def data_record(trainer: pl.Trainer | None, data_parallel_size: int) -> dict[str, int] | None:
    """What a checkpoint keeps to continue its epoch in samples on any layout; None without a training loader of
    one batch size (before fit, several loaders, a custom batch sampler): those resume in batches."""
    if trainer is None:
        return None
    batch = loader_batch_size(trainer.train_dataloader)
    if batch is None:
        return None
    return {"samples_per_batch": batch * data_parallel_size, "accumulate_grad_batches": trainer.accumulate_grad_batches}


def loader_batch_size(loader: Any) -> int | None:
    """A training loader's batch size (its ``batch_size``, or its batch sampler's); None when it has none."""
    size = getattr(loader, "batch_size", None)
    if size is None:
        size = getattr(getattr(loader, "batch_sampler", None), "batch_size", None)
    return size if isinstance(size, int) and size >= 1 else None


def continue_in_samples(trainer: pl.Trainer, skip: int, saved: dict[str, int], samples_per_batch: int) -> int:
    """The batches to skip in this run for the ``skip`` batches of ``saved``'s run; Lightning's batch counters are
    recounted to match. Raises where the consumed samples are not a whole number of this run's batch steps."""
    then = saved["samples_per_batch"]
    if then == samples_per_batch or not skip:
        return skip
    samples = skip * then
    if samples % samples_per_batch:
        raise ValueError(
            f"The checkpoint stopped after {samples} samples of its epoch ({skip} batch steps of {then} samples),"
            f" which this run's batch steps of {samples_per_batch} samples (per-rank batch x data-parallel size) do"
            " not divide: it cannot continue that epoch exactly. Choose a per-rank batch size or data-parallel size"
            f" whose product divides {samples}, or resume from a checkpoint saved at an epoch's end."
        )
    now = samples // samples_per_batch
    progress = trainer.fit_loop.epoch_loop.batch_progress
    for counts in (progress.current, progress.total):
        for name in ("ready", "started", "processed", "completed"):
            setattr(counts, name, getattr(counts, name) + now - skip)
    return now


def batches_to_skip(trainer: pl.Trainer, accumulate_grad_batches: int | None = None) -> tuple[int, int]:
    """``(batches consumed in the interrupted epoch, that epoch)``, from the restored loops; ``(0, epoch)`` when
    the checkpoint was saved at an epoch boundary. Mirrors how Lightning's loops count the restarted epoch;
    ``accumulate_grad_batches``: the saving run's (default: the Trainer's)."""
    fit_loop = trainer.fit_loop
    epoch = fit_loop.epoch_progress.current.processed  # type: ignore[attr-defined]  # a _ProcessedTracker
    fit_loop.update_restart_stage()  # recomputed by `fit_loop.reset()` as well; only read here
    if not fit_loop.restarted_mid_epoch:
        return 0, epoch
    epoch_loop = fit_loop.epoch_loop
    progress = epoch_loop.batch_progress
    consumed = progress.current.completed
    if epoch_loop.restarted_on_train_batch_end:
        if progress.is_last_batch:
            return 0, epoch  # the epoch's last batch had finished: Lightning starts the next epoch
        accumulating = progress.current.ready % (accumulate_grad_batches or trainer.accumulate_grad_batches) != 0
        if not accumulating:
            consumed += 1  # saved in `on_train_batch_end`: Lightning counts the batch as completed
    return consumed, epoch


def align_loops_with_data(checkpoint: dict[str, Any]) -> None:
    """Store a checkpoint saved once its epoch's end had begun as if saved in ``on_train_batch_end`` of the epoch's
    last finished batch: the one state Lightning's loops (and :func:`batches_to_skip`) resume exactly from.

    Lightning's fit loop marks an epoch processed before ``on_train_epoch_end`` and completed after it, also when
    ``max_steps`` or ``should_stop`` ended the epoch before its last batch. Restored as they are, those counters
    start the next epoch instead of finishing a cut-short one (a save after ``fit(max_steps=k)`` returned), and
    after a finished epoch they run one empty epoch, so that the sampler order is the one of the epoch after
    (a save in ``on_train_epoch_end``, or after ``fit`` returned). A save during an epoch is left as it is.
    """
    fit = checkpoint.get("loops", {}).get("fit_loop") or {}
    epochs, batches = fit.get("epoch_progress"), fit.get("epoch_loop.batch_progress")
    if not epochs or not batches:
        return
    last = batches["current"]
    if not last["ready"] == last["started"] == last["processed"] == last["completed"] > 0:
        return  # saved inside a batch
    if epochs["total"]["processed"] != epochs["total"]["started"]:
        return  # the epoch's end has not begun
    for counts in (epochs["total"], epochs["current"]):
        counts["processed"] -= 1
        counts["completed"] = min(counts["completed"], counts["processed"])
    for counts in (batches["total"], batches["current"]):
        counts["completed"] -= 1
    loop_state = fit.get("epoch_loop.state_dict", {})
    if "_batches_that_stepped" in loop_state:
        loop_state["_batches_that_stepped"] -= 1  # counted after `on_train_batch_end`; Lightning adds it back
    checkpoint["epoch"] = epochs["current"]["completed"]


class FastForward:
    """The training loader, whose next iterator starts ``skip`` batches into epoch ``epoch``.

    Everything else (``len``, ``sampler``, ``dataset``, later epochs) is the wrapped loader's. The first
    iterator is built with the RNG isolated: the interrupted run had built it at the start of the epoch, and
    its random draws are not part of the RNG state the checkpoint restored.
    """

    def __init__(self, loader: Any, skip: int, epoch: int) -> None:
        self.loader = loader
        self.skip = skip
        self.epoch = epoch

    def __iter__(self) -> Iterator[object]:
        if not self.skip:
            return iter(self.loader)
        skip, self.skip = self.skip, 0
        with isolate_rng():
            set_sampler_epoch(self.loader, self.epoch)
            return _skipping_iterator(self.loader, skip)

    def __len__(self) -> int:
        return len(self.loader)

    def __getattr__(self, name: str) -> Any:
        if name == "loader":  # not set yet (unpickling)
            raise AttributeError(name)
        return getattr(self.loader, name)

    def __setattr__(self, name: str, value: object) -> None:
        # Lightning sets e.g. `worker_init_fn` on the loader it is given: it belongs to the wrapped loader.
        if name in ("loader", "skip", "epoch"):
            object.__setattr__(self, name, value)
        else:
            setattr(self.loader, name, value)


def _skipping_iterator(loader: Any, skip: int) -> Iterator[object]:
    if isinstance(loader, DataLoader) and not isinstance(loader.dataset, IterableDataset):
        # Skip indices, not batches: nothing is loaded for the skipped part, worker processes included.
        attribute = "batch_sampler" if loader.batch_sampler is not None else "sampler"
        # DataLoader refuses to set these after __init__; the clone is private to this one iterator.
        return iter(with_sampler(loader, attribute, _SkipFirst(getattr(loader, attribute), skip)))
    # Iterable datasets and other iterables: the skipped batches have to be produced and dropped.
    return itertools.islice(iter(loader), skip, None)


class _SkipFirst:
    def __init__(self, sampler: Any, skip: int) -> None:
        self.sampler = sampler
        self.skip = skip

    def __iter__(self) -> Iterator[object]:
        return itertools.islice(iter(self.sampler), self.skip, None)

    def __len__(self) -> int:
        return max(0, len(self.sampler) - self.skip)

    def __getattr__(self, name: str) -> Any:
        if name == "sampler":
            raise AttributeError(name)
        return getattr(self.sampler, name)
