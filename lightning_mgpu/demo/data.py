"""Character-level language-modelling data: a bundled public-domain text, byte tokens, fixed-length windows.

Everything is deterministic and offline: the text ships with the package, the tokenizer needs no vocabulary
file, and the train/validation split is a fixed cut of the token stream, so every process sees the same data.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path

import lightning as L
import torch
from torch.utils.data import DataLoader, Dataset

DEFAULT_TEXT = "shakespeare.txt"


def load_text(path: str | Path | None = None) -> str:
    """Read ``path``, or the bundled Shakespeare sonnets when ``path`` is ``None``."""
    if path is not None:
        return Path(path).read_text(encoding="utf-8")
    return resources.files("lightning_mgpu.demo").joinpath("data", DEFAULT_TEXT).read_text(encoding="utf-8")


class CharTokenizer:
    """Byte-level tokenizer: every UTF-8 byte is a token, so the vocabulary is fixed at 256 and needs no file."""

    vocab_size: int = 256

    def encode(self, text: str) -> torch.Tensor:
        """UTF-8 bytes of ``text`` as a 1-D ``LongTensor``."""
        return torch.tensor(list(text.encode("utf-8")), dtype=torch.long)

    def decode(self, ids: torch.Tensor | list[int]) -> str:
        """Inverse of :meth:`encode`; bytes cut mid-character become U+FFFD instead of raising."""
        if isinstance(ids, torch.Tensor):
            ids = ids.tolist()
        return bytes(ids).decode("utf-8", errors="replace")


class TextDataset(Dataset):
    """``(x, y)`` windows of ``block_size`` tokens, ``y`` shifted by one, starting every ``stride`` tokens.

    ``stride`` defaults to ``block_size`` (non-overlapping windows), which keeps an epoch short and every sample
    distinct; a smaller stride yields more, overlapping samples.
    """

    def __init__(self, tokens: torch.Tensor, block_size: int, stride: int | None = None) -> None:
        if tokens.dim() != 1:
            raise ValueError(f"`tokens` must be 1-D, got shape {tuple(tokens.shape)}.")
        self.tokens = tokens.long()
        self.block_size = block_size
        self.stride = stride or block_size
        if block_size < 1 or self.stride < 1:
            raise ValueError("`block_size` and `stride` must be positive.")
        if len(self.tokens) < block_size + 1:
            raise ValueError(f"{len(self.tokens)} tokens are too few for one window of block_size={block_size}.")

    def __len__(self) -> int:
        return (len(self.tokens) - self.block_size - 1) // self.stride + 1

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not 0 <= index < len(self):
            raise IndexError(index)
        start = index * self.stride
        chunk = self.tokens[start : start + self.block_size + 1]
        return chunk[:-1].clone(), chunk[1:].clone()


class TextDataModule(L.LightningDataModule):
    """Train on the first ``1 - val_fraction`` of the text, validate on the rest.

    The split is a contiguous cut (not a random one) so validation text is genuinely unseen and the split is
    identical in every process without any seeding. Loaders use ``num_workers=0``: the data is tiny and worker
    processes only add start-up time and nondeterminism on CPU.
    """

    def __init__(
        self,
        batch_size: int = 16,
        block_size: int = 128,
        val_fraction: float = 0.1,
        shuffle: bool = False,
        stride: int | None = None,
        path: str | None = None,
    ) -> None:
        super().__init__()
        if not 0.0 <= val_fraction < 1.0:
            raise ValueError(f"`val_fraction` must be in [0, 1), got {val_fraction}.")
        self.save_hyperparameters()
        self.batch_size = batch_size
        self.block_size = block_size
        self.val_fraction = val_fraction
        self.shuffle = shuffle
        self.stride = stride
        self.path = path
        self.tokenizer = CharTokenizer()
        self.train_dataset: TextDataset | None = None
        self.val_dataset: TextDataset | None = None

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.vocab_size

    def setup(self, stage: str | None = None) -> None:
        if self.train_dataset is not None:
            return
        tokens = self.tokenizer.encode(load_text(self.path))
        n_val = int(len(tokens) * self.val_fraction)
        n_train = len(tokens) - n_val
        self.train_dataset = TextDataset(tokens[:n_train], self.block_size, self.stride)
        if n_val > 0:
            self.val_dataset = TextDataset(tokens[n_train:], self.block_size, self.stride)

    def train_dataloader(self) -> DataLoader:
        assert self.train_dataset is not None, "call setup() first"
        return DataLoader(self.train_dataset, batch_size=self.batch_size, shuffle=self.shuffle, num_workers=0)

    def val_dataloader(self) -> DataLoader | list:
        if self.val_dataset is None:
            return []
        return DataLoader(self.val_dataset, batch_size=self.batch_size, shuffle=False, num_workers=0)
