"""A self-contained demo: nanoGPT trained on bundled Shakespeare, written as an ordinary Lightning program."""

from lightning_mgpu.demo.data import CharTokenizer, TextDataModule, TextDataset, load_text
from lightning_mgpu.demo.gpt import GPT, MLP, Block, CausalSelfAttention, GPTConfig
from lightning_mgpu.demo.module import GPTLightningModule

__all__ = [
    "GPT",
    "MLP",
    "Block",
    "CausalSelfAttention",
    "CharTokenizer",
    "GPTConfig",
    "GPTLightningModule",
    "TextDataModule",
    "TextDataset",
    "load_text",
]
