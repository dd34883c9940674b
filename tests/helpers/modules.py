"""Small, deterministic LightningModules and DataModules written the way a user would write them.

None of them knows about parallelism: the tests run them unchanged under ``HybridStrategy`` and compare against
a single-process run. Each trains in well under a second per step on CPU. ``seed`` (default ``None``) seeds only
the weight init and leaves the global RNG untouched, so the test harness stays in control of seeding.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


@contextlib.contextmanager
def _seeded(seed: int | None) -> Iterator[None]:
    """Seed the CPU RNG for the block and restore it afterwards; a no-op when ``seed`` is ``None``."""
    if seed is None:
        yield
        return
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        yield


def _lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))


class _CausalLMModule(L.LightningModule):
    """Shared loop for the Hugging Face causal LMs: the user computes the loss from ``.logits`` themselves."""

    model: nn.Module

    def __init__(self, lr: float = 1e-3) -> None:
        super().__init__()
        self.lr = lr

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=input_ids).logits

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = _lm_loss(self.model(input_ids=x).logits, y)
        self.log("train_loss", loss, prog_bar=True, sync_dist=True)
        return loss

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", _lm_loss(self.model(input_ids=x).logits, y), sync_dist=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.lr, weight_decay=0.01)


class LlamaModule(_CausalLMModule):
    """Tiny Hugging Face Llama (GQA: 4 query heads, 2 KV heads by default; RMSNorm; SwiGLU; RoPE), ~90K parameters."""

    def __init__(
        self,
        vocab_size: int = 128,
        max_seq_len: int = 64,
        lr: float = 1e-3,
        seed: int | None = None,
        num_key_value_heads: int = 2,
    ) -> None:
        super().__init__(lr=lr)
        self.save_hyperparameters()
        from transformers import LlamaConfig, LlamaForCausalLM

        config = LlamaConfig(
            vocab_size=vocab_size,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=num_key_value_heads,
            max_position_embeddings=max_seq_len,
            tie_word_embeddings=False,
            bos_token_id=0,
            eos_token_id=1,
            attn_implementation="eager",
        )
        with _seeded(seed):
            self.model = LlamaForCausalLM(config)


class GPT2Module(_CausalLMModule):
    """Tiny Hugging Face GPT-2 (fused ``c_attn``, ``Conv1D`` layers with transposed weights), ~100K parameters.

    Dropout is off so single- and multi-process runs are comparable. ``tie_word_embeddings`` defaults to
    ``False`` (GPT-2's own default is ``True``) so that the basic tests have one owner per parameter.
    """

    def __init__(
        self,
        vocab_size: int = 128,
        max_seq_len: int = 64,
        lr: float = 1e-3,
        tie_word_embeddings: bool = False,
        seed: int | None = None,
    ) -> None:
        super().__init__(lr=lr)
        self.save_hyperparameters()
        from transformers import GPT2Config, GPT2LMHeadModel

        config = GPT2Config(
            vocab_size=vocab_size,
            n_positions=max_seq_len,
            n_embd=64,
            n_layer=2,
            n_head=4,
            n_inner=128,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
            tie_word_embeddings=tie_word_embeddings,
            bos_token_id=0,
            eos_token_id=0,
            attn_implementation="eager",
        )
        with _seeded(seed):
            self.model = GPT2LMHeadModel(config)


class CNNModule(L.LightningModule):
    """Small CNN on 3x16x16 images; two param groups (no decay on norms/biases) and a StepLR schedule."""

    def __init__(self, num_classes: int = 10, lr: float = 0.05, seed: int | None = None) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.lr = lr
        with _seeded(seed):
            self.conv1 = nn.Conv2d(3, 16, kernel_size=3, padding=1)
            self.norm1 = nn.GroupNorm(4, 16)
            self.conv2 = nn.Conv2d(16, 32, kernel_size=3, padding=1)
            self.norm2 = nn.GroupNorm(8, 32)
            self.head = nn.Linear(32, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.max_pool2d(F.relu(self.norm1(self.conv1(x))), 2)  # 16x16 -> 8x8
        x = F.relu(self.norm2(self.conv2(x)))
        return self.head(F.adaptive_avg_pool2d(x, 1).flatten(1))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.log("train_loss", loss, prog_bar=True, sync_dist=True)
        return loss

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", F.cross_entropy(self(x), y), sync_dist=True)

    def configure_optimizers(self) -> Any:
        decay = [p for p in self.parameters() if p.dim() > 1]
        no_decay = [p for p in self.parameters() if p.dim() <= 1]
        groups = [{"params": decay, "weight_decay": 1e-4}, {"params": no_decay, "weight_decay": 0.0}]
        optimizer = torch.optim.SGD(groups, lr=self.lr, momentum=0.9)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


class _TensorDataModule(L.LightningDataModule):
    """Serves fixed tensors built once in ``__init__`` from a private generator: identical in every process."""

    def __init__(self, batch_size: int, with_val: bool) -> None:
        super().__init__()
        self.batch_size = batch_size
        self.with_val = with_val
        self.train_data: TensorDataset
        self.val_data: TensorDataset

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.train_data, batch_size=self.batch_size, shuffle=False, num_workers=0)

    def val_dataloader(self) -> Any:
        # An empty list makes Lightning skip validation (with a harmless "length is zero" UserWarning).
        if not self.with_val:
            return []
        return DataLoader(self.val_data, batch_size=self.batch_size, shuffle=False, num_workers=0)


class RandomTokenDataModule(_TensorDataModule):
    """``(x, y)`` token sequences with ``y`` the next-token shift of one random stream per sample."""

    def __init__(
        self,
        vocab_size: int = 128,
        seq_len: int = 32,
        num_samples: int = 64,
        batch_size: int = 8,
        with_val: bool = False,
        seed: int = 1234,
    ) -> None:
        super().__init__(batch_size, with_val)
        g = torch.Generator().manual_seed(seed)
        tokens = torch.randint(0, vocab_size, (2 * num_samples, seq_len + 1), generator=g)
        self.train_data = TensorDataset(tokens[:num_samples, :-1], tokens[:num_samples, 1:])
        self.val_data = TensorDataset(tokens[num_samples:, :-1], tokens[num_samples:, 1:])


class RandomImageDataModule(_TensorDataModule):
    """``(image, label)`` pairs: ``3 x size x size`` standard-normal images with uniform labels."""

    def __init__(
        self,
        num_classes: int = 10,
        size: int = 16,
        num_samples: int = 64,
        batch_size: int = 8,
        with_val: bool = False,
        seed: int = 1234,
    ) -> None:
        super().__init__(batch_size, with_val)
        g = torch.Generator().manual_seed(seed)
        images = torch.randn(2 * num_samples, 3, size, size, generator=g)
        labels = torch.randint(0, num_classes, (2 * num_samples,), generator=g)
        self.train_data = TensorDataset(images[:num_samples], labels[:num_samples])
        self.val_data = TensorDataset(images[num_samples:], labels[num_samples:])
