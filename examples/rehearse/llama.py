"""A Hugging Face Llama LightningModule built from shapes, as a user would train one: ``lightning-mgpu plan
--module examples.rehearse.llama:LlamaLM --init-args '{...}' --rehearse`` builds it on the meta device (no memory).

The defaults are Llama-2-70B's shapes (80 layers, width 8192, 64 heads, 8 key/value heads, MLP 28672, vocabulary
32000, untied head).
"""

from __future__ import annotations

import lightning as L
import torch
from transformers import LlamaConfig, LlamaForCausalLM


class LlamaLM(L.LightningModule):
    def __init__(
        self,
        hidden_size: int = 8192,
        intermediate_size: int = 28672,
        num_hidden_layers: int = 80,
        num_attention_heads: int = 64,
        num_key_value_heads: int = 8,
        vocab_size: int = 32000,
        max_position_embeddings: int = 4096,
        lr: float = 1.5e-4,
    ) -> None:
        super().__init__()
        self.lr = lr
        config = LlamaConfig(
            hidden_size=hidden_size,
            intermediate_size=intermediate_size,
            num_hidden_layers=num_hidden_layers,
            num_attention_heads=num_attention_heads,
            num_key_value_heads=num_key_value_heads,
            vocab_size=vocab_size,
            max_position_embeddings=max_position_embeddings,
            tie_word_embeddings=False,
        )
        self.model = LlamaForCausalLM(config)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        tokens, _ = batch  # (tokens, next tokens); the model shifts its labels itself
        loss = self.model(input_ids=tokens, labels=tokens).loss
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.lr, weight_decay=0.1)
