"""The order of use read from a model's code (``parallel/call_order.py``) and the pipeline placement built on it."""

from __future__ import annotations

import lightning as L
import pytest
import torch
from torch import nn

from lightning_mgpu.parallel.pipeline.call_order import use_order
from lightning_mgpu.parallel.pipeline.plan import plan_split


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x)


class HeadFirst(nn.Module):
    """litgpt's registration order: the head before the body that holds the blocks."""

    def __init__(self) -> None:
        super().__init__()
        self.lm_head = nn.Linear(4, 4)
        self.transformer = nn.ModuleDict(dict(wte=nn.Embedding(8, 4), h=nn.ModuleList([_Block(), _Block()])))
        self.transformer["ln_f"] = nn.LayerNorm(4)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.transformer.wte(idx)
        for block in self.transformer.h:
            x = block(x)
        return self.lm_head(self.transformer.ln_f(x))


class TokensFirst(nn.Module):
    """A ViT's shape: parameters held by the model itself, used in a method before the blocks; ``len(self.blocks)``
    read before anything runs."""

    def __init__(self) -> None:
        super().__init__()
        self.depth = 0
        self.cls_token = nn.Parameter(torch.zeros(1, 1, 4))
        self.pos_embed = nn.Parameter(torch.zeros(1, 3, 4))
        self.blocks = nn.Sequential(_Block(), _Block())
        self.patch = nn.Linear(4, 4)
        self.head = nn.Linear(4, 4)

    def _pos_embed(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.cat([self.cls_token.expand(x.size(0), -1, -1), x], dim=1)
        return x + self.pos_embed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.depth = len(self.blocks)
        x = self._pos_embed(self.patch(x))
        return self.head(self.blocks(x)[:, 0])


class Wrapper(L.LightningModule):
    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def training_step(self, batch, batch_idx):
        x, _ = batch
        return self.model(x).sum()


def test_order_of_use_follows_calls_into_submodules_and_methods():
    order = use_order(Wrapper(HeadFirst()))
    names = [n for n in order if n.startswith("model.")]
    assert names.index("model.transformer.wte") < names.index("model.transformer.h") < names.index("model.lm_head")
    order = use_order(Wrapper(TokensFirst()))
    assert order.index("model.patch") < order.index("model.cls_token") < order.index("model.blocks")
    assert order.index("model.blocks") < order.index("model.head")


def test_pipeline_places_by_use_not_registration():
    split = plan_split(Wrapper(HeadFirst()), 2, "auto")
    assert split.before == ["model.transformer.wte"]
    assert split.after == ["model.lm_head", "model.transformer.ln_f"]
    split = plan_split(Wrapper(TokensFirst()), 2, "auto")
    assert split.before == ["model.patch"] and split.after == ["model.head"]
    assert split.before_parameters == ["model.cls_token", "model.pos_embed"] and split.after_parameters == []


class SplitUse(TokensFirst):
    """A parameter of the model used after the blocks beside one used before them: no one stage can own both."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) * self.scale


def test_a_module_whose_own_parameters_are_used_before_and_after_the_blocks_is_refused():
    with pytest.raises(NotImplementedError, match=r"used before the pipeline's blocks.*Use pipeline_parallel_size=1"):
        plan_split(Wrapper(SplitUse()), 2, "auto")


_NO_SOURCE: dict = {}
exec("def forward(self, idx):\n    return self.lm_head(self.transformer.ln_f(self.transformer.wte(idx)))", _NO_SOURCE)


class NoSource(HeadFirst):
    forward = _NO_SOURCE["forward"]  # made by exec: inspect cannot find its source


def test_code_that_cannot_be_read_falls_back_to_registration_order():
    split = plan_split(Wrapper(NoSource()), 2, "auto")
    assert "model.lm_head" in split.before  # registered before the blocks' parent, so taken as before them
