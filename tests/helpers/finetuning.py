"""Fine-tuning modules as users write them: a frozen backbone unfrozen mid-training by Lightning's
``BackboneFinetuning``, layers frozen for the whole run, and LoRA adapters from ``peft`` on a Hugging Face model.

The backbone module follows Lightning's ``computer_vision_fine_tuning`` example (a pretrained backbone under
``self.backbone``, a new classification head, ``BackboneFinetuning`` adding the backbone to the optimizer as a
parameter group when it unfreezes it), with a small CNN of ResNet's units in place of torchvision's ResNet-50:
torchvision does not install beside the CPU build of torch here. ``norm="group"`` puts GroupNorm where ResNet has
BatchNorm: a data-parallel or pipelined run can then equal one process's (BatchNorm's statistics are per rank and
per microbatch without SyncBatchNorm, which torch runs on GPUs only).
"""

from __future__ import annotations

from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

NUM_CLASSES = 4


def _block(channels_in: int, channels_out: int, norm: str) -> nn.Module:
    """ResNet's unit: a convolution without bias (the norm after it has one), the norm, ReLU."""
    conv = nn.Conv2d(channels_in, channels_out, 3, padding=1, bias=False)
    layer = nn.BatchNorm2d(channels_out) if norm == "batch" else nn.GroupNorm(2, channels_out)
    return nn.Sequential(conv, layer, nn.ReLU())


class TransferLearningModel(L.LightningModule):
    """Lightning's example shape: ``self.backbone`` (repeated conv blocks), a new ``self.head``; the optimizer
    starts with the head's parameters only (``BackboneFinetuning`` adds the backbone's)."""

    def __init__(self, lr: float = 1e-2, width: int = 8, blocks: int = 4, norm: str = "batch") -> None:
        super().__init__()
        self.lr = lr
        layers = [_block(3, width, norm), *[_block(width, width, norm) for _ in range(blocks - 1)]]
        self.backbone = nn.Sequential(*layers)
        self.head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(width, NUM_CLASSES))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.backbone(x))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(filter(lambda p: p.requires_grad, self.parameters()), lr=self.lr)


class FrozenEmbeddingsLM(L.LightningModule):
    """A Hugging Face Llama whose embeddings and first block stay frozen for the whole run (``requires_grad``)."""

    def __init__(self, lr: float = 1e-3) -> None:
        super().__init__()
        from transformers import LlamaConfig, LlamaForCausalLM

        config = LlamaConfig(
            vocab_size=128,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=64,
        )
        self.model = LlamaForCausalLM(config)
        self.model.model.embed_tokens.requires_grad_(False)
        self.model.model.layers[0].requires_grad_(False)
        self.lr = lr

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        logits = self.model(input_ids=x).logits
        loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1))
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=self.lr)


class LoraLM(FrozenEmbeddingsLM):
    """LoRA adapters (``peft.get_peft_model``) on the attention's q and v projections (``peft``'s default for
    Llama), or on ``target_modules``: the base weights frozen."""

    def __init__(self, lr: float = 1e-2, target_modules: tuple[str, ...] = ("q_proj", "v_proj"), **lora: Any) -> None:
        super().__init__(lr=lr)
        from peft import LoraConfig, get_peft_model

        self.model.requires_grad_(True)
        config = LoraConfig(r=4, lora_alpha=8, target_modules=list(target_modules), **lora)
        self.model = get_peft_model(self.model, config)


# Every projection of a Llama block: adapters beside column-parallel (q, k, v, gate, up) and row-parallel (o, down).
LLAMA_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class ImageDataModule(L.LightningDataModule):
    def __init__(self, batch_size: int = 8, num_samples: int = 32, size: int = 8, seed: int = 1234) -> None:
        super().__init__()
        self.batch_size = batch_size
        g = torch.Generator().manual_seed(seed)
        self.data = TensorDataset(
            torch.randn(num_samples, 3, size, size, generator=g),
            torch.randint(0, NUM_CLASSES, (num_samples,), generator=g),
        )

    def train_dataloader(self) -> Any:
        return DataLoader(self.data, batch_size=self.batch_size)
