"""The demo ``LightningModule``: an ordinary single-device training loop around :class:`GPT`.

Nothing here knows about tensor, pipeline or data parallelism; that is the point of the demo. The same module
trains on one CPU with the default strategy and on many GPUs with ``HybridStrategy``.
"""

from __future__ import annotations

from typing import Any

import lightning as L
import torch
import torch.nn.functional as F

from lightning_mgpu.demo.gpt import GPT, GPTConfig


class GPTLightningModule(L.LightningModule):
    """Next-token prediction with cross-entropy, AdamW and an optional linear LR warmup.

    The model config is taken as plain keyword arguments so ``save_hyperparameters()`` records it and
    ``LightningCLI`` exposes it. ``seed`` (default ``None``) seeds only the weight init and leaves the global RNG
    as it was, so callers that seed globally keep control.
    """

    def __init__(
        self,
        vocab_size: int = 256,
        block_size: int = 128,
        n_layer: int = 4,
        n_head: int = 4,
        n_embd: int = 128,
        bias: bool = True,
        dropout: float = 0.0,
        lr: float = 3e-4,
        weight_decay: float = 0.1,
        betas: tuple[float, float] = (0.9, 0.95),
        warmup_steps: int = 0,
        seed: int | None = None,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.config = GPTConfig(
            vocab_size=vocab_size,
            block_size=block_size,
            n_layer=n_layer,
            n_head=n_head,
            n_embd=n_embd,
            bias=bias,
            dropout=dropout,
        )
        if seed is None:
            self.model = GPT(self.config)
        else:
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(seed)
                self.model = GPT(self.config)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.model(idx)

    def _loss(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = batch
        logits = self(x)
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = self._loss(batch)
        self.log("train_loss", loss, prog_bar=True, sync_dist=True)
        return loss

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = self._loss(batch)
        self.log("val_loss", loss, prog_bar=True, sync_dist=True)
        return loss

    def configure_optimizers(self) -> Any:
        """AdamW with nanoGPT's grouping: decay matrices and embeddings, never biases or norm weights."""
        hp: Any = self.hparams  # AttributeDict: the saved init arguments, read as attributes
        params = [p for p in self.parameters() if p.requires_grad]
        groups = [
            {"params": [p for p in params if p.dim() >= 2], "weight_decay": hp.weight_decay},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
        ]
        optimizer = torch.optim.AdamW(groups, lr=hp.lr, betas=tuple(hp.betas))
        if hp.warmup_steps <= 0:
            return optimizer
        warmup = hp.warmup_steps
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / warmup))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}
