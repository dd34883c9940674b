"""Karpathy's nanoGPT, as published, inside the usual LightningModule, trained with ``LightningCLI``.

The model (``nanogpt_model.py``) reshapes with global sizes read from its input and config; ``HybridStrategy``
shards it under tensor parallelism with ``tp_plan="auto"`` (its blocks' ``c_attn``/``c_fc`` column-wise,
``c_proj`` row-wise) without any edit. From the repository root::

    python examples/cli/train_nanogpt.py fit --config examples/cli/nanogpt_tp.yaml

Run as a script, the other processes are started by re-running this command, so keep the entry point under
``if __name__ == "__main__":``.
"""

from __future__ import annotations

from typing import Any

import lightning as L
from lightning.pytorch.cli import LightningCLI

import lightning_mgpu  # noqa: F401  (registers the "hybrid*" strategy names with Lightning)
from lightning_mgpu.demo import TextDataModule
from nanogpt_model import GPT, GPTConfig  # this folder is on sys.path when the script runs


class NanoGPTModule(L.LightningModule):
    """The loss comes from ``model(x, y)``; the optimizer is nanoGPT's own (weight-decay groups)."""

    def __init__(self, n_layer: int = 4, n_head: int = 4, n_embd: int = 64, vocab_size: int = 256,
                 block_size: int = 32, dropout: float = 0.0, lr: float = 3e-3, weight_decay: float = 0.1) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.model = GPT(GPTConfig(block_size=block_size, vocab_size=vocab_size, n_layer=n_layer, n_head=n_head,
                                   n_embd=n_embd, dropout=dropout))

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        x, y = batch
        _, loss = self.model(x, y)
        self.log("train_loss", loss, prog_bar=True, sync_dist=True)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        _, loss = self.model(x, y)
        self.log("val_loss", loss, prog_bar=True, sync_dist=True)

    def configure_optimizers(self) -> Any:
        return self.model.configure_optimizers(self.hparams.weight_decay, self.hparams.lr, (0.9, 0.95),
                                               self.device.type)


def main() -> None:
    LightningCLI(NanoGPTModule, TextDataModule, save_config_kwargs={"overwrite": True})


if __name__ == "__main__":
    main()
