"""A model whose state-dict keys are not its parameter names (its own state-dict hooks rename them) trains, tears
down and checkpoints like one process, and its checkpoint resumes in other layouts.

torchtitan 0.3's ``FusedQKVLinear`` is such a model: it holds one fused ``wqkv`` parameter and saves it as
``wq``/``wk``/``wv`` (a ``state_dict`` post-hook splits it, a ``load_state_dict`` pre-hook merges it back). Its
attention has no CPU backward, so :class:`FusedQKV` does the same with the same two hooks (redistributing a DTensor
to replicated first, as torchtitan's hooks do). torch's ``get_model_state_dict`` cannot follow such hooks (it looks
each key up as an attribute path: "'FusedQKV' object has no attribute 'wq'").
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Replicate

from tests.helpers.equivalence import assert_same_training, fit
from tests.helpers.modules import RandomTokenDataModule
from tests.test_checkpoint import CROSS_LAYOUT_RTOL, SaveAt, _losses_match

STEPS, SAVED_AT = 6, 3
_PARTS = ("wq", "wk", "wv")


class FusedQKV(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.wqkv = nn.Linear(dim, 3 * dim, bias=False)
        self.register_state_dict_post_hook(_split_on_save)
        self.register_load_state_dict_pre_hook(_merge_on_load)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return tuple(self.wqkv(x).chunk(3, dim=-1))


def _replicated(tensor: torch.Tensor) -> torch.Tensor:
    if isinstance(tensor, DTensor):
        return tensor.redistribute(tensor.device_mesh, [Replicate()] * tensor.device_mesh.ndim)
    return tensor


def _split_on_save(module: nn.Module, state: dict[str, Any], prefix: str, local_metadata: Any) -> None:
    fused = _replicated(state.pop(f"{prefix}wqkv.weight"))
    for name, part in zip(_PARTS, fused.chunk(3, dim=0)):
        state[f"{prefix}{name}.weight"] = part.contiguous()


def _merge_on_load(module: nn.Module, state: dict[str, Any], prefix: str, *args: Any) -> None:
    if all(f"{prefix}{name}.weight" in state for name in _PARTS):
        parts = [_replicated(state.pop(f"{prefix}{name}.weight")) for name in _PARTS]
        state[f"{prefix}wqkv.weight"] = torch.cat(parts, dim=0)


class Block(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.qkv = FusedQKV(dim)
        self.out = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(self.norm(x))
        return x + self.out(F.scaled_dot_product_attention(q, k, v, is_causal=True))


class HookedLM(L.LightningModule):
    def __init__(self, vocab: int = 64, dim: int = 32, layers: int = 2) -> None:
        super().__init__()
        self.embedding = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(Block(dim) for _ in range(layers))
        self.head = nn.Linear(dim, vocab)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embedding(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.cross_entropy(self(x).flatten(0, 1), y.flatten())
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def _data(batch: int) -> Any:
    return functools.partial(RandomTokenDataModule, vocab_size=64, seq_len=16, batch_size=batch)


def test_state_dict_hooks_train_save_and_resume_in_other_layouts(tmp_path: Path) -> None:
    reference, _ = fit(HookedLM, _data(8), None, 1, STEPS)
    assert {f"blocks.0.qkv.{name}.weight" for name in _PARTS} <= reference.state_dict.keys()

    saved, _ = fit(
        HookedLM, _data(8), {"tensor_parallel_size": 2}, 2, STEPS,
        callbacks_factory=lambda: [SaveAt(tmp_path, (SAVED_AT,))],
    )  # fmt: skip
    assert_same_training(reference, saved)  # the plain module put back at teardown, under the model's own keys
    checkpoint = tmp_path / f"step{SAVED_AT}.ckpt"
    for strategy, dp in (({"zero_stage": 3}, 2), ({"pipeline_parallel_size": 2}, 1)):
        resumed, _ = fit(HookedLM, _data(8 // dp), strategy, 2, STEPS, fit_kwargs={"ckpt_path": str(checkpoint)})
        _losses_match(reference.losses, resumed.losses, SAVED_AT, CROSS_LAYOUT_RTOL)
        for key, value in reference.state_dict.items():
            close = functools.partial(torch.testing.assert_close, rtol=1e-4, atol=1e-5)
            close(resumed.state_dict[key], value, msg=lambda m, key=key: f"{key}: {m}")
