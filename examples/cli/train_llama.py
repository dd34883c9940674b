"""A Hugging Face ``LlamaForCausalLM`` inside an ordinary LightningModule, trained with ``LightningCLI``.

The model is built from a ``LlamaConfig`` with random weights (nothing is downloaded); the sizes are
``--model.*`` arguments. The module is written for one device and calls the Hugging Face model the usual way,
``self.model(input_ids=x, labels=y)``; ``HybridStrategy`` shards it with the model's own tensor-parallel plan
(``config.base_model_tp_plan``). From the repository root::

    python examples/cli/train_llama.py fit --config examples/cli/llama_tp.yaml
    python examples/cli/train_llama.py fit --config examples/cli/llama_tp.yaml --model.num_hidden_layers=4

To start from pretrained weights instead, build ``self.model`` with ``LlamaForCausalLM.from_pretrained(name)``.
Run as a script, the other processes are started by re-running this command, so keep the entry point under
``if __name__ == "__main__":``.
"""

from __future__ import annotations

from typing import Any

import lightning as L
import torch
from lightning.pytorch.cli import LightningCLI

import lightning_mgpu  # noqa: F401  (registers the "hybrid*" strategy names with Lightning)
from lightning_mgpu.demo import TextDataModule


# --8<-- [start:module]
class LlamaLightningModule(L.LightningModule):
    """Next-byte prediction with a small Llama (GQA, RMSNorm, SwiGLU, RoPE); the loss is the model's own."""

    def __init__(
        self,
        vocab_size: int = 256,  # TextDataModule's byte tokens
        hidden_size: int = 64,
        intermediate_size: int = 128,
        num_hidden_layers: int = 2,
        num_attention_heads: int = 4,
        num_key_value_heads: int = 2,
        max_position_embeddings: int = 128,
        lr: float = 3e-3,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        from transformers import LlamaConfig, LlamaForCausalLM

        config = LlamaConfig(
            vocab_size=vocab_size,
            hidden_size=hidden_size,
            intermediate_size=intermediate_size,
            num_hidden_layers=num_hidden_layers,
            num_attention_heads=num_attention_heads,
            num_key_value_heads=num_key_value_heads,
            max_position_embeddings=max_position_embeddings,
            tie_word_embeddings=False,
            bos_token_id=0,
            eos_token_id=1,
        )
        self.model = LlamaForCausalLM(config)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = self._loss(batch)
        self.log("train_loss", loss, prog_bar=True, sync_dist=True)
        return loss

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        self.log("val_loss", self._loss(batch), prog_bar=True, sync_dist=True)

    def _loss(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        # The Hugging Face way: `labels=input_ids`, the model shifts them and computes the cross-entropy itself
        # (TextDataModule's shifted targets are not needed).
        x, _ = batch
        return self.model(input_ids=x, labels=x).loss

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr, weight_decay=0.0)
# --8<-- [end:module]


def main() -> None:
    LightningCLI(LlamaLightningModule, TextDataModule, save_config_kwargs={"overwrite": True})


if __name__ == "__main__":
    main()
