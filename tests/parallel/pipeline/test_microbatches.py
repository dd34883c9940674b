"""Any data under pipeline parallelism: ragged last batches, iterable datasets, sequence lengths that change.

Every case trains whole epochs (so the ragged batch is reached, in training and in validation) and is compared
with plain Lightning on one process.
"""

from __future__ import annotations

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader, IterableDataset

from lightning_mgpu.demo import GPTLightningModule
from lightning_mgpu.parallel.pipeline.microbatches import MicrobatchPlan, plan_microbatches
from tests.helpers.equivalence import assert_same_training, fit
from tests.helpers.modules import RandomTokenDataModule
from tests.helpers.probes import MetricRecorder

GLOBAL_BATCH = 8
WEIGHT_ATOL = 1e-4
EPOCHS = {"max_epochs": 2, "num_sanity_val_steps": 0}


def _nanogpt():
    return GPTLightningModule(block_size=32, n_layer=4, n_head=4, n_embd=32, lr=1e-3)


def test_ragged_batches_get_equal_microbatches_the_schedule_can_run():
    assert plan_microbatches("1F1B", 2, 8, 2, 2) == MicrobatchPlan(2, "1F1B")
    assert plan_microbatches("1F1B", 4, 6, 2, 2) == MicrobatchPlan(3, "1F1B")  # the largest count below
    assert plan_microbatches("1F1B", 2, 3, 2, 2) == MicrobatchPlan(3, "1F1B")  # else the smallest above
    assert plan_microbatches("1F1B", 2, 1, 2, 2) == MicrobatchPlan(1, "GPipe")  # else the same placement, any count
    assert plan_microbatches("DualPipeV", 4, 2, 2, 4) == MicrobatchPlan(2, "ZBVZeroBubble")
    assert plan_microbatches("Interleaved1F1B", 4, 5, 2, 4) == MicrobatchPlan(1, "Interleaved1F1B")
    assert plan_microbatches("GPipe", 4, 7, 2, 2) == MicrobatchPlan(1, "GPipe")


def _tokens(num_samples: int):
    # 27 samples: batches of 8, 8, 8 and a ragged 3 (train and validation) in one process.
    return lambda batch: RandomTokenDataModule(vocab_size=256, num_samples=num_samples, batch_size=batch, with_val=True)


_references: dict = {}


def _check(strategy: dict, devices: int, dp: int, num_samples: int) -> None:
    data = _tokens(num_samples)
    if num_samples not in _references:
        _references[num_samples] = fit(
            _nanogpt,
            lambda: data(GLOBAL_BATCH),
            None,
            1,
            -1,
            trainer_kwargs=EPOCHS,
            callbacks_factory=lambda: [MetricRecorder()],
        )
    reference, reference_extras = _references[num_samples]
    result, extras = fit(
        _nanogpt,
        lambda: data(GLOBAL_BATCH // dp),
        strategy,
        devices,
        -1,
        trainer_kwargs=EPOCHS,
        callbacks_factory=lambda: [MetricRecorder()],
    )
    assert len(reference.losses) == 8  # two epochs of four batches, the last ragged
    assert_same_training(reference, result, weight_atol=WEIGHT_ATOL)
    expected, got = reference_extras[0]["val_losses"], extras[0]["val_losses"]
    assert len(got) == len(expected) == 2
    torch.testing.assert_close(torch.tensor(got), torch.tensor(expected), rtol=1e-5, atol=0)


RAGGED = [  # (strategy, devices, dp, samples): 27 = 3 x 8 + 3; 26 = 2 ranks x (3 x 4 + 1), no sampler padding
    ({"pipeline_parallel_size": 2}, 2, 1, 27),
    ({"pipeline_parallel_size": 2, "num_microbatches": 4}, 2, 1, 27),
    ({"pipeline_parallel_size": 2, "zero_stage": 1}, 4, 2, 26),
    ({"pipeline_parallel_size": 2, "tensor_parallel_size": 2}, 4, 1, 27),
    ({"tensor_parallel_size": 2, "zero_stage": 3}, 4, 2, 26),  # no pipeline: nothing to cut, still exact
]


@pytest.mark.parametrize(
    ("strategy", "devices", "dp", "samples"),
    RAGGED,
    ids=["pp2-m2", "pp2-m4", "pp2-dp2-zero1", "pp2-tp2", "dp2-tp2-zero3"],
)
def test_ragged_last_batches_train_and_validate_like_one_process(strategy, devices, dp, samples):
    _check(strategy, devices, dp, samples)


class _Stream(IterableDataset):
    """Token samples from a generator, without ``__len__``: Lightning cannot tell the epoch's length."""

    def __init__(self, num_samples: int, seq_len: int = 32) -> None:
        self.num_samples, self.seq_len = num_samples, seq_len

    def __iter__(self):
        g = torch.Generator().manual_seed(5)
        for _ in range(self.num_samples):
            tokens = torch.randint(0, 256, (self.seq_len + 1,), generator=g)
            yield tokens[:-1], tokens[1:]


class _VaryingLengths(torch.utils.data.Sampler):
    """Batches of one length each, the length changing from batch to batch (a length-bucketing sampler)."""

    def __init__(self, lengths: list[int], batch_size: int) -> None:
        self.lengths, self.batch_size = lengths, batch_size

    def __iter__(self):
        by_length: dict[int, list[int]] = {}
        for index, length in enumerate(self.lengths):
            by_length.setdefault(length, []).append(index)
        for indices in by_length.values():
            for start in range(0, len(indices), self.batch_size):
                yield indices[start : start + self.batch_size]

    def __len__(self) -> int:
        return sum(-(-self.lengths.count(n) // self.batch_size) for n in set(self.lengths))


def _pad_to_longest(samples):
    """A padding collator: sequences of a batch padded to its longest (here all of a batch share a length)."""
    length = max(x.shape[0] for x, _ in samples)
    xs = torch.stack([torch.nn.functional.pad(x, (0, length - x.shape[0])) for x, _ in samples])
    ys = torch.stack([torch.nn.functional.pad(y, (0, length - y.shape[0]), value=-100) for _, y in samples])
    return xs, ys


class _OddData(L.LightningDataModule):
    def __init__(self, kind: str, batch_size: int) -> None:
        super().__init__()
        self.kind, self.batch_size = kind, batch_size

    def train_dataloader(self):
        if self.kind == "iterable":
            return DataLoader(_Stream(27), batch_size=self.batch_size)
        g = torch.Generator().manual_seed(6)
        lengths = [(8, 16, 32)[i % 3] for i in range(30)]
        samples = [torch.randint(0, 256, (n + 1,), generator=g) for n in lengths]
        dataset = [(s[:-1], s[1:]) for s in samples]
        return DataLoader(dataset, batch_sampler=_VaryingLengths(lengths, self.batch_size), collate_fn=_pad_to_longest)


@pytest.mark.parametrize("kind", ["iterable", "lengths"])
def test_iterable_data_and_changing_sequence_lengths(kind):
    trainer_kwargs = {**EPOCHS, "use_distributed_sampler": False}  # the data is the same on every rank
    reference, _ = fit(_nanogpt, lambda: _OddData(kind, GLOBAL_BATCH), None, 1, -1, trainer_kwargs=trainer_kwargs)
    result, _ = fit(
        _nanogpt,
        lambda: _OddData(kind, GLOBAL_BATCH),
        {"pipeline_parallel_size": 2},
        2,
        -1,
        trainer_kwargs=trainer_kwargs,
    )
    assert len(reference.losses) == 8 if kind == "iterable" else 12
    assert_same_training(reference, result, weight_atol=WEIGHT_ATOL)


class _Evaluated(GPTLightningModule):
    def test_step(self, batch, batch_idx):
        x, y = batch
        logits = self(x)
        self.log("test_loss", torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1)))

    def validation_step(self, batch, batch_idx, dataloader_idx=0):  # two dataloaders below
        return super().validation_step(batch, batch_idx)

    def predict_step(self, batch, batch_idx):
        return self(batch[0]).argmax(-1)


def _evaluate_worker(strategy_kwargs):
    from lightning_mgpu import HybridStrategy

    L.seed_everything(7)
    module = _Evaluated(block_size=32, n_layer=4, n_head=4, n_embd=32)
    strategy = HybridStrategy(**strategy_kwargs) if strategy_kwargs else "auto"
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2 if strategy_kwargs else 1,
        strategy=strategy,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    data = _tokens(27)(GLOBAL_BATCH)  # validation data of 27 samples: 8, 8, 8 and a ragged 3
    tested = trainer.test(module, data.val_dataloader(), verbose=False)[0]["test_loss"]
    validated = trainer.validate(module, data.val_dataloader(), verbose=False)[0]["val_loss"]
    # Two dataloaders: each logs under its own name (`val_loss/dataloader_idx_<i>`), never into the other's.
    both = trainer.validate(module, [data.val_dataloader(), _tokens(19)(GLOBAL_BATCH).val_dataloader()], verbose=False)
    return tested, validated, trainer.predict(module, data.val_dataloader()), both


def test_test_validate_and_predict_serve_ragged_batches_like_one_process():
    from tests.helpers.distributed import run_distributed

    reference = run_distributed(_evaluate_worker, 1, None)[0]
    for tested, validated, predictions, both in run_distributed(_evaluate_worker, 2, {"pipeline_parallel_size": 2}):
        assert tested == pytest.approx(reference[0], rel=1e-5) and validated == pytest.approx(reference[1], rel=1e-5)
        assert [sorted(d) for d in both] == [[f"val_loss/dataloader_idx_{i}"] for i in (0, 1)], both
        losses = [value for d in reference[3] for value in d.values()]
        assert losses[0] != pytest.approx(losses[1], rel=1e-3)  # the two dataloaders differ: a mix-up would show
        for got, expected in zip(both, reference[3]):
            assert got == pytest.approx(expected, rel=1e-5)
        assert [p.shape[0] for p in predictions] == [8, 8, 8, 3]
        for got, expected in zip(predictions, reference[2]):
            assert torch.equal(got, expected)
