"""Models built from torch's own Transformer modules, as users write them or as Lightning publishes them.

- ``DemoTransformer``: Lightning's demo ``LightningTransformer`` (``lightning.pytorch.demos.transformer``: an
  ``nn.Transformer`` encoder-decoder between an embedding and a linear decoder, SGD at lr 0.1) used as published,
  with three changes a comparison needs and nothing else: its ``Transformer`` built with ``dropout=0.0`` (no layout
  reproduces one process's random masks) and a small vocabulary, its loss logged as ``train_loss`` over every
  data-parallel rank (the demo logs nothing), and no download in ``prepare_data`` (the data is synthetic). Sizes as
  published: width 200, 2 heads, 2 encoder and 2 decoder layers unless ``nlayers`` says otherwise.
- ``TorchEncoderLM``: a causal language model a user writes from ``nn.TransformerEncoder`` (batch first, a causal
  mask with ``is_causal``).

``demo_data`` is the published loader's shape: one sequence of 35 tokens per batch (``DataLoader(WikiText2())``).
"""

from __future__ import annotations

from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from lightning.pytorch.demos.transformer import LightningTransformer, Transformer
from torch import nn

from tests.helpers.modules import RandomTokenDataModule

VOCAB = 128
DEMO_SEQUENCE = 35  # WikiText2(block_size=35), the demo's dataset


class DemoTransformer(LightningTransformer):
    def __init__(self, nlayers: int = 2) -> None:
        super().__init__(vocab_size=VOCAB)
        self.model = Transformer(vocab_size=VOCAB, nlayers=nlayers, dropout=0.0)

    def prepare_data(self) -> None:
        pass  # the published one downloads WikiText-2

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        self.log("train_loss", loss, sync_dist=True)
        return loss


def demo_data(batch_size: int = 1) -> RandomTokenDataModule:
    return RandomTokenDataModule(vocab_size=VOCAB, seq_len=DEMO_SEQUENCE, batch_size=batch_size)


class TorchEncoderLM(L.LightningModule):
    def __init__(self, width: int = 32, heads: int = 4, layers: int = 2) -> None:
        super().__init__()
        self.embedding = nn.Embedding(VOCAB, width)
        layer = nn.TransformerEncoderLayer(width, heads, 4 * width, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers)
        self.head = nn.Linear(width, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        mask = nn.Transformer.generate_square_subsequent_mask(tokens.size(1), device=tokens.device)
        return self.head(self.encoder(self.embedding(tokens), mask=mask, is_causal=True))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.cross_entropy(self(x).flatten(0, 1), y.flatten())
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def encoder_data(batch_size: int = 8) -> RandomTokenDataModule:
    return RandomTokenDataModule(vocab_size=VOCAB, seq_len=16, batch_size=batch_size)
