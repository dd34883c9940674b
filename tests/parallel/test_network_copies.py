"""Modules that hold a copy of their own network (issue 47, item 3): a DQN's target network synced with
``target_net.load_state_dict(net.state_dict())``, an EMA teacher distilled from and updated in place.

Tensor parallelism shards the copy as the plan shards the network (``plan.with_network_copies``), so that weights
copied between them keep their layouts; ZeRO-3 shards both over data parallelism; pipeline parallelism, which would
give each stage part of the network and all of the copy, refuses such a module at setup with the fix.
"""

from __future__ import annotations

import copy
import functools
from typing import Any

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_mgpu.parallel.blocks import network_copies
from lightning_mgpu.parallel.pipeline.plan import plan_split
from tests.helpers.batched import Run, fit_each, result
from tests.helpers.dqn import DQNModule, ReplayDataModule
from tests.helpers.equivalence import FIND_UNUSED, assert_same_training
from tests.helpers.tiers import case
from tests.helpers.torch_transformers import VOCAB, encoder_data


class _EncoderNet(nn.Module):
    def __init__(self, width: int = 32, heads: int = 4, layers: int = 2) -> None:
        super().__init__()
        self.embedding = nn.Embedding(VOCAB, width)
        layer = nn.TransformerEncoderLayer(width, heads, 4 * width, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers)
        self.head = nn.Linear(width, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        mask = nn.Transformer.generate_square_subsequent_mask(tokens.size(1), device=tokens.device)
        return self.head(self.encoder(self.embedding(tokens), mask=mask, is_causal=True))


class EMADistillation(L.LightningModule):
    """A student distilled from an EMA teacher of itself (the mean-teacher pattern): the teacher is a copy made at
    construction, never trained, and follows the student's weights after every step."""

    def __init__(self, decay: float = 0.9) -> None:
        super().__init__()
        self.decay = decay
        self.student = _EncoderNet()
        self.teacher = copy.deepcopy(self.student).requires_grad_(False)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        logits = self.student(x)
        with torch.no_grad():
            target = F.softmax(self.teacher(x), dim=-1)
        distill = F.kl_div(F.log_softmax(logits, dim=-1), target, reduction="batchmean")
        loss = F.cross_entropy(logits.flatten(0, 1), y.flatten()) + distill
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        with torch.no_grad():
            for teacher, student in zip(self.teacher.parameters(), self.student.parameters(), strict=True):
                teacher.lerp_(student, 1.0 - self.decay)

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.student.parameters(), lr=1e-3)


def test_a_network_and_its_copy_are_found_but_not_alike_layers_or_blocks():
    assert network_copies(DQNModule()) == [("net", "target_net")]
    assert network_copies(EMADistillation()) == [("student", "teacher")]
    # Alike by design, not copies: the blocks of a list, a decoder layer's self- and cross-attention, q and k, two
    # lists of projections (Gemma 3n's altup projections in and out).
    decoder = nn.TransformerDecoder(nn.TransformerDecoderLayer(16, 2, 32), 2)
    attention = nn.Module()
    attention.q, attention.k = nn.Linear(8, 8), nn.Linear(8, 8)
    lists = nn.Module()
    lists.into, lists.out = nn.ModuleList([nn.Linear(8, 8)]), nn.ModuleList([nn.Linear(8, 8)])
    assert network_copies(decoder) == network_copies(attention) == network_copies(lists) == []


def test_pipeline_parallelism_refuses_a_split_network_with_a_copy_before_training():
    with pytest.raises(ValueError, match=r"splits 'net' .* also holds 'target_net', a copy of it.*tensor parallelism"):
        plan_split(DQNModule(), 2, "auto")
    with pytest.raises(ValueError, match=r"splits 'student' .* also holds 'teacher'.*pipeline_parallel_size=1"):
        plan_split(EMADistillation(), 2, "auto")


DQN_STEPS = 12  # the target network is synced at steps 0 and 10 (sync_rate=10, as published)
DQN_PLAN = {"net.net.0": "colwise", "net.net.2": "rowwise"}  # the online network only: the copy follows it
MODELS = {  # factory, data at a given batch size, global batch, steps, the reference's strategy
    "DQN": (DQNModule, ReplayDataModule, 16, DQN_STEPS, FIND_UNUSED),  # the target network's weights get no gradient
    "EMA": (EMADistillation, encoder_data, 8, 10, None),
}
LAYOUTS = [  # (name, model, strategy, devices)
    case("DQN tp2", "DQN", {"tensor_parallel_size": 2, "tp_plan": DQN_PLAN}, 2, id="dqn-tp2"),
    case("DQN dp2 ZeRO-3", "DQN", {"zero_stage": 3}, 2, id="dqn-dp2-z3"),
    case("EMA tp2", "EMA", {"tensor_parallel_size": 2}, 2, id="ema-tp2-auto"),
    case("EMA dp2 ZeRO-3", "EMA", {"zero_stage": 3}, 2, id="ema-dp2-z3"),
    case(
        "DQN dp2 x tp2 ZeRO-3",
        "DQN",
        {"tensor_parallel_size": 2, "tp_plan": DQN_PLAN, "zero_stage": 3},
        4,
        id="dqn-dp2-tp2-z3",
        slow=True,
    ),
    case(
        "EMA dp2 x tp2 ZeRO-3", "EMA", {"tensor_parallel_size": 2, "zero_stage": 3}, 4, id="ema-dp2-tp2-z3", slow=True
    ),
]
# AdamW turns rounding noise on gradients that are zero in exact arithmetic into lr-sized steps: torch attention's
# key bias (softmax ignores a shift of the scores), which the EMA teacher then follows.
KEY_BIAS_ATOL = {
    f"{net}.encoder.layers.{i}.self_attn.in_proj_bias": 1e-3 for net in ("student", "teacher") for i in (0, 1)
}


@functools.cache
def _trained(devices: int) -> dict[str, Any]:
    runs = {}
    for param in LAYOUTS:
        name, model, strategy, world = param.values
        if world == devices:
            factory, data, batch, steps, _ = MODELS[model]
            dp = devices // strategy.get("tensor_parallel_size", 1)
            runs[name] = Run(factory, functools.partial(data, batch // dp), strategy, steps)
    return fit_each(runs, devices, 900)


@functools.cache
def _references() -> dict[str, Any]:
    runs = {
        model: Run(factory, functools.partial(data, batch), reference, steps)
        for model, (factory, data, batch, steps, reference) in MODELS.items()
    }
    return fit_each(runs, 1, 900)


@pytest.mark.parametrize(("name", "model", "strategy", "devices"), LAYOUTS)
def test_a_module_with_a_copy_of_its_network_trains_like_one_process(name, model, strategy, devices):
    trained, _ = result(_trained(devices)[name])
    reference, _ = result(_references()[model])
    assert_same_training(reference, trained, weight_atol=1e-4, weight_atols=KEY_BIAS_ATOL)
