"""modded-nanogpt's GPT as its `train_gpt.py` writes the model's dataflow, and the Lightning wrapper around it.

What pipeline parallelism cares about is kept as published: the embeddings normed into ``x = x0``, every block
taking ``(x, ve, x0)`` and mixing ``x0`` back in through learned ``lambdas``, value embeddings shared by the first
and the last blocks, and U-Net skip connections (the first half's outputs added back, in reverse, before the second
half's blocks) weighted by ``skip_weights``. What only runs on CUDA is replaced by its plain torch equivalent:
FlexAttention with block masks by causal ``scaled_dot_product_attention``, the FP8 ``CastedLinear`` head by
``nn.Linear``; rotary embeddings and the logit soft-cap are left out (they do not change the dataflow).
"""

from __future__ import annotations

import lightning as L
import torch
import torch.nn as nn
import torch.nn.functional as F


def norm(x: torch.Tensor) -> torch.Tensor:
    return F.rms_norm(x, (x.size(-1),))


class CausalSelfAttention(nn.Module):
    def __init__(self, dim: int, num_heads: int):
        super().__init__()
        self.num_heads = num_heads
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.lambdas = nn.Parameter(torch.tensor([0.5, 0.5]))
        self.c_proj = nn.Linear(dim, dim, bias=False)

    def forward(self, x: torch.Tensor, ve: torch.Tensor | None) -> torch.Tensor:
        B, T = x.size(0), x.size(1)
        q, k, v = self.qkv(x).view(B, T, 3 * self.num_heads, -1).chunk(3, dim=-2)
        q, k = norm(q), norm(k)
        if ve is not None:
            v = self.lambdas[0] * v + self.lambdas[1] * ve.view_as(v)  # @KoszarskyB & @Grad62304977
        else:  # skip mid-layers token value embeddings by @YouJiacheng
            v = self.lambdas[0] * v
        y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        return self.c_proj(y.transpose(1, 2).contiguous().view(B, T, -1))


class MLP(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.c_fc = nn.Linear(dim, 4 * dim, bias=False)
        self.c_proj = nn.Linear(4 * dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(F.relu(self.c_fc(x)).square())  # https://arxiv.org/abs/2109.08668v2


class Block(nn.Module):
    def __init__(self, dim: int, num_heads: int):
        super().__init__()
        self.attn = CausalSelfAttention(dim, num_heads)
        self.mlp = MLP(dim)
        self.lambdas = nn.Parameter(torch.tensor([1.0, 0.0]))

    def forward(self, x: torch.Tensor, ve: torch.Tensor | None, x0: torch.Tensor) -> torch.Tensor:
        x = self.lambdas[0] * x + self.lambdas[1] * x0
        x = x + self.attn(norm(x), ve)
        return x + self.mlp(norm(x))


class GPT(nn.Module):
    def __init__(self, vocab_size: int = 256, num_layers: int = 4, num_heads: int = 2, model_dim: int = 32):
        super().__init__()
        self.embed = nn.Embedding(vocab_size, model_dim)
        # token value embeddings by @KoszarskyB - inspired by @Grad62304977's value residual learning
        self.value_embeds = nn.ModuleList([nn.Embedding(vocab_size, model_dim) for _ in range(2)])
        self.blocks = nn.ModuleList([Block(model_dim, num_heads) for _ in range(num_layers)])
        self.lm_head = nn.Linear(model_dim, vocab_size, bias=False)
        # U-net design by @brendanh0gan
        self.num_encoder_layers = num_layers // 2  # Half of the layers for encoder
        self.num_decoder_layers = num_layers - self.num_encoder_layers  # Remaining for decoder
        # Add learnable skip connection weights for decoder layers
        self.skip_weights = nn.Parameter(torch.ones(self.num_decoder_layers))

    def forward(self, input_seq: torch.Tensor) -> torch.Tensor:
        ve = [value_embed(input_seq) for value_embed in self.value_embeds]
        ve = [ve[0]] + [None] * (len(self.blocks) - 2) + [ve[1]]
        x = x0 = norm(self.embed(input_seq))
        # Store outputs for U-Net skip connections
        skip_connections = []
        # Encoder pass - process only the first half of the blocks
        for i in range(self.num_encoder_layers):
            x = self.blocks[i](x, ve[i], x0)
            skip_connections.append(x)
        # Decoder pass - process the remaining blocks with weighted skip connections
        for i in range(self.num_decoder_layers):
            x = x + self.skip_weights[i] * skip_connections.pop()
            x = self.blocks[self.num_encoder_layers + i](x, ve[self.num_encoder_layers + i], x0)
        return self.lm_head(norm(x))


class ModdedGPTModule(L.LightningModule):
    """The Lightning wrapper a user writes: the loss from the logits, AdamW over every parameter."""

    def __init__(self, **config):
        super().__init__()
        self.model = GPT(**config)

    def forward(self, input_seq: torch.Tensor) -> torch.Tensor:
        return self.model(input_seq)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self(x).flatten(0, 1), y.flatten())
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)
