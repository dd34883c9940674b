"""The memory savers: activation checkpointing per block (names, numerics, memory, every layout) and CPU offload."""

from __future__ import annotations

import copy

import lightning as L
import pytest
import torch
from torch import nn

from lightning_mgpu import HybridStrategy
from lightning_mgpu.demo import GPTLightningModule, TextDataModule
from lightning_mgpu.parallel.activation import ActivationMemory, apply_activation_checkpointing, is_checkpointed
from tests.helpers.equivalence import assert_same_training, fit
from tests.helpers.modules import CNNModule, LlamaModule, RandomTokenDataModule

AC_LOSS_RTOL = 1e-6  # recomputation repeats the same ops in the same order: in practice bit-identical


def _gpt(n_layer: int = 2) -> GPTLightningModule:
    return GPTLightningModule(block_size=32, n_layer=n_layer, n_head=4, n_embd=32, weight_decay=0.1, lr=1e-3)


def _step(module: nn.Module, tokens: torch.Tensor) -> tuple[float, list[torch.Tensor]]:
    module.zero_grad(set_to_none=True)
    loss = module(tokens).float().pow(2).mean()
    loss.backward()
    return loss.item(), [p.grad.clone() for p in module.parameters()]


@pytest.mark.parametrize("mode", [True, "full", "selective", "classes"])
@pytest.mark.parametrize("model", ["llama", "gpt"])
def test_checkpointing_keeps_names_and_gradients(model, mode):
    plain = LlamaModule(seed=0) if model == "llama" else GPTLightningModule(block_size=32, n_layer=2, seed=0)
    if mode == "classes":
        blocks = plain.model.model.layers if model == "llama" else plain.model.transformer.h
        mode = [type(blocks[0])]
    checkpointed = copy.deepcopy(plain)
    targets = apply_activation_checkpointing(checkpointed, mode)
    assert len(targets) == 2 and all(is_checkpointed(t) for t in targets)
    assert list(checkpointed.state_dict()) == list(plain.state_dict())  # no `_checkpoint_wrapped_module.`
    assert [n for n, _ in checkpointed.named_parameters()] == [n for n, _ in plain.named_parameters()]
    tokens = torch.randint(0, 128, (4, 32), generator=torch.Generator().manual_seed(0))
    loss, grads = _step(checkpointed, tokens)
    ref_loss, ref_grads = _step(plain, tokens)
    assert loss == ref_loss
    for grad, ref in zip(grads, ref_grads):
        torch.testing.assert_close(grad, ref, rtol=0, atol=0)
    # A deep copy (EMA/SWA callbacks make one) recomputes through its own weights.
    clone = copy.deepcopy(checkpointed)
    assert clone.state_dict().keys() == plain.state_dict().keys()
    with torch.no_grad():
        for p in clone.parameters():
            p.mul_(0.5)
    assert _step(clone, tokens)[0] != loss


def test_checkpointing_refuses_what_it_cannot_do():
    with pytest.raises(ValueError, match=r"found no repeated blocks .* activation_checkpointing=\[MyBlock\]"):
        apply_activation_checkpointing(CNNModule(), True)
    with pytest.raises(ValueError, match="matches no module"):
        apply_activation_checkpointing(CNNModule(), [nn.LSTM])
    cnn = CNNModule()
    assert len(apply_activation_checkpointing(cnn, [nn.Conv2d, nn.GroupNorm])) == 4  # explicit classes work anywhere
    module = LlamaModule()
    apply_activation_checkpointing(module, "full")
    with pytest.raises(RuntimeError, match="already applied"):
        apply_activation_checkpointing(module, "full")
    with pytest.raises(ValueError, match="activation_checkpointing"):
        HybridStrategy(activation_checkpointing="sometimes")


def _activation_bytes(module: nn.Module, tokens: torch.Tensor) -> tuple[int, int]:
    with ActivationMemory() as memory:
        loss = module(tokens).float().pow(2).mean()
        held = memory.held_bytes(exclude=list(module.parameters()))
        loss.backward()
    return held, memory.peak_bytes


# Measured on this 4-layer GPT (n_embd 128, batch 8 x 128 tokens, fp32): activations held after forward 34.1 MiB
# without checkpointing, 4.0 MiB with "full" (x8.5 less), 24.1 MiB with "selective" (x1.42 less); peak over
# forward + backward 41.3 / 16.3 / 31.2 MiB. The test prints the line.
FULL_FACTOR_AT_LEAST = 4.0
SELECTIVE_FACTOR_AT_LEAST = 1.2


def test_activation_memory_saved_is_measured():
    plain = GPTLightningModule(block_size=128, n_layer=4, n_head=4, n_embd=128, seed=0)
    tokens = torch.randint(0, 256, (8, 128), generator=torch.Generator().manual_seed(0))
    held, peak = {}, {}
    for mode in (False, "full", "selective"):
        module = copy.deepcopy(plain)
        if mode:
            apply_activation_checkpointing(module, mode)
        held[mode], peak[mode] = _activation_bytes(module, tokens)
    full, selective = held[False] / held["full"], held[False] / held["selective"]
    print(
        f"activations held after forward: none {held[False] / 2**20:.2f} MiB, full {held['full'] / 2**20:.2f} MiB"
        f" (x{full:.1f} less), selective {held['selective'] / 2**20:.2f} MiB (x{selective:.2f} less);"
        f" peak over forward+backward: {peak[False] / 2**20:.2f} / {peak['full'] / 2**20:.2f} /"
        f" {peak['selective'] / 2**20:.2f} MiB"
    )
    assert full >= FULL_FACTOR_AT_LEAST
    assert selective >= SELECTIVE_FACTOR_AT_LEAST
    assert peak["full"] < peak[False] and peak["selective"] < peak[False]


@pytest.mark.parametrize(
    "layout,mode,model",
    [
        ({"zero_stage": 0}, "selective", "llama"),
        ({"zero_stage": 3}, "full", "llama"),
        ({"zero_stage": 2}, "full", "gpt"),
        ({"tensor_parallel_size": 2}, "selective", "llama"),
        ({"pipeline_parallel_size": 2}, "full", "llama"),
    ],
    ids=["dp2-zero0-selective", "dp2-zero3-full", "dp2-zero2-full-gpt", "tp2-selective", "pp2-full"],
)
def test_checkpointing_in_every_layout_trains_the_same(layout, mode, model):
    world, steps = 2, 6
    dp = 1 if "tensor_parallel_size" in layout or "pipeline_parallel_size" in layout else 2
    module, data = (
        (LlamaModule, lambda: RandomTokenDataModule(batch_size=8 // dp))
        if model == "llama"
        else (_gpt, lambda: TextDataModule(batch_size=8 // dp, block_size=32))
    )
    plain, _ = fit(module, data, layout, world, steps)
    checkpointed, _ = fit(module, data, {**layout, "activation_checkpointing": mode}, world, steps)
    assert_same_training(plain, checkpointed, loss_rtol=AC_LOSS_RTOL, weight_rtol=1e-6, weight_atol=1e-7)


def test_cpu_offload_needs_zero_3():
    for stage in (0, 1, 2):
        with pytest.raises(ValueError, match=f"cpu_offload=True.*needs zero_stage=3, got zero_stage={stage}"):
            HybridStrategy(zero_stage=stage, cpu_offload=True)
    HybridStrategy(zero_stage=3, cpu_offload=True)


class _OffloadProbe(L.Callback):
    def __init__(self) -> None:
        self.results: dict = {}

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        from torch.distributed.fsdp import FSDPModule

        groups = [m._get_fsdp_state()._fsdp_param_group for m in pl_module.modules() if isinstance(m, FSDPModule)]
        self.results["policies"] = {type(g.offload_policy).__name__ for g in groups if g is not None}


def test_cpu_offload_trains_like_one_process():
    data = lambda: RandomTokenDataModule(batch_size=8)
    reference, _ = fit(LlamaModule, data, None, 1, 6)
    offloaded, extras = fit(
        LlamaModule,
        lambda: RandomTokenDataModule(batch_size=4),
        {"zero_stage": 3, "cpu_offload": True},
        2,
        6,
        callbacks_factory=lambda: [_OffloadProbe()],
    )
    assert all(e["policies"] == {"CPUOffloadPolicy"} for e in extras), extras
    assert_same_training(reference, offloaded)
