"""DDP's search for parameters left without a gradient (zero_stage 0/1): decided by the first step unless set."""

from __future__ import annotations

import lightning as L
import pytest
import torch
from torch import nn

from lightning_mgpu.demo import GPTLightningModule, TextDataModule
from tests.helpers.equivalence import assert_same_training, fit

STEPS = 4


class _GPTWithWarmupLoss(GPTLightningModule):
    """An auxiliary loss for the first two steps only (a warm-up term, as some recipes add): from step 3 on, its
    head's parameters get no gradient."""

    def __init__(self):
        super().__init__(block_size=32, n_layer=2, n_head=4, n_embd=32, weight_decay=0.1, lr=1e-3)
        self.warmup_head = nn.Linear(32, 1)

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        if self.global_step < 2:
            loss = loss + 0.1 * self.warmup_head(self.model.transformer.wte.weight[:4]).pow(2).mean()
        return loss


class _GPTWithRankLocalHead(GPTLightningModule):
    """A head only rank 0 uses (as a routed expert that gets no token on some ranks): a parameter without a gradient
    on one rank, in every step."""

    def __init__(self):
        super().__init__(block_size=32, n_layer=2, n_head=4, n_embd=32, weight_decay=0.1, lr=1e-3)
        self.head = nn.Linear(32, 1)

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        if self.global_rank == 0:
            loss = loss + 0.1 * self.head(self.model.transformer.wte.weight[:4]).pow(2).mean()
        return loss


def _data(batch):
    return lambda: TextDataModule(batch_size=batch, block_size=32)


def test_a_parameter_unused_after_the_first_step_stops_the_run_naming_the_fix():
    """Every parameter had a gradient in step 1, so the search was turned off; step 3, the last, leaves the warm-up
    head without one: the run stops right after that backward, before the optimizer steps on gradients DDP did not
    reduce (not a hang, not a silent update, not DDP's own message about its constructor)."""
    with pytest.raises(
        RuntimeError, match=r"Step 3 of this run left a parameter without a gradient.*find_unused_parameters=True"
    ):
        fit(_GPTWithWarmupLoss, _data(4), {"zero_stage": 0}, 2, 3)


class _GPTWithFirstMicroStepLoss(GPTLightningModule):
    """An auxiliary loss on the first micro-step of each accumulated step only: the micro-step that synchronizes
    gradients leaves its head without a gradient."""

    def __init__(self):
        super().__init__(block_size=32, n_layer=2, n_head=4, n_embd=32, weight_decay=0.1, lr=1e-3)
        self.aux_head = nn.Linear(32, 1)

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        if batch_idx % 2 == 0:
            loss = loss + 0.1 * self.aux_head(self.model.transformer.wte.weight[:4]).pow(2).mean()
        return loss


def test_accumulation_decides_from_the_micro_step_that_synchronizes():
    """DDP's own map of used parameters counts the accumulating micro-steps too; the decision must not: the head
    gets no gradient in the synchronizing micro-step, so the search stays on and training matches one process."""
    accumulate = {"accumulate_grad_batches": 2}
    single, _ = fit(_GPTWithFirstMicroStepLoss, _data(8), {}, 1, STEPS, trainer_kwargs=accumulate)
    result, _ = fit(_GPTWithFirstMicroStepLoss, _data(4), {"zero_stage": 1}, 2, STEPS, trainer_kwargs=accumulate)
    assert_same_training(single, result)


@pytest.mark.parametrize("zero_stage", [0, 1])
def test_find_unused_parameters_true_trains_like_one_process(zero_stage):
    single, _ = fit(_GPTWithWarmupLoss, _data(8), {}, 1, STEPS)  # one process, no wrapper (DDP would refuse)
    result, _ = fit(_GPTWithWarmupLoss, _data(4), {"zero_stage": zero_stage, "find_unused_parameters": True}, 2, STEPS)
    assert_same_training(single, result)


class _HeadWeights(L.Callback):
    """Each rank's ``head.weight`` at the start and the end of the fit."""

    def __init__(self):
        self.results = {}

    def on_train_start(self, trainer, pl_module):
        self.results["start"] = pl_module.head.weight.detach().clone()

    def on_train_end(self, trainer, pl_module):
        self.results["end"] = pl_module.head.weight.detach().clone()


def test_a_parameter_one_rank_leaves_unused_in_the_first_step_keeps_the_search_on():
    """Step 1 shows a parameter without a gradient on rank 1: the search stays on, so every later step trains (the
    head, which only rank 0 uses, gets the average of rank 0's gradient and none), and the replicas stay equal."""
    result, extras = fit(
        _GPTWithRankLocalHead, _data(4), {"zero_stage": 0}, 2, STEPS, callbacks_factory=lambda: [_HeadWeights()]
    )
    assert len(result.losses) == STEPS
    assert not torch.equal(extras[0]["start"], extras[0]["end"])  # trained
    assert torch.equal(extras[0]["end"], extras[1]["end"])
