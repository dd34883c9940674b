"""A Hugging Face Mixtral LightningModule built from shapes: ``lightning-mgpu plan --module
examples.rehearse.mixtral:MixtralLM --fix tp=2,pp=2,ep=8,zero=1 --gpus 64 --rehearse`` builds it on the meta device.

The defaults are Mixtral-8x7B's shapes (32 layers, width 4096, 32 heads, 8 key/value heads, 8 experts of MLP 14336,
2 per token, vocabulary 32000).
"""

from __future__ import annotations

from typing import Any

import lightning as L
import torch
from transformers import MixtralConfig, MixtralForCausalLM


class MixtralLM(L.LightningModule):
    def __init__(
        self,
        hidden_size: int = 4096,
        intermediate_size: int = 14336,
        num_hidden_layers: int = 32,
        num_attention_heads: int = 32,
        num_key_value_heads: int = 8,
        num_local_experts: int = 8,
        num_experts_per_tok: int = 2,
        vocab_size: int = 32000,
        lr: float = 1e-4,
        **config: Any,
    ) -> None:
        super().__init__()
        self.lr = lr
        self.model = MixtralForCausalLM(
            MixtralConfig(
                hidden_size=hidden_size,
                intermediate_size=intermediate_size,
                num_hidden_layers=num_hidden_layers,
                num_attention_heads=num_attention_heads,
                num_key_value_heads=num_key_value_heads,
                num_local_experts=num_local_experts,
                num_experts_per_tok=num_experts_per_tok,
                vocab_size=vocab_size,
                **config,
            )
        )

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        tokens, _ = batch  # (tokens, next tokens); the model shifts its labels itself
        loss = self.model(input_ids=tokens, labels=tokens).loss
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.lr, weight_decay=0.1)
