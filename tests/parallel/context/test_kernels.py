"""The choice of kernel for a context-parallel attention block: every branch of ``choose_kernel`` (CUDA ones
included, from the device description alone), what ``device_of`` reads from torch, and the one log line."""

from __future__ import annotations

import logging

import pytest
import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_only
from torch.nn.attention import SDPBackend, sdpa_kernel

from lightning_mgpu.parallel.context import kernels
from lightning_mgpu.parallel.context.kernels import Device, KernelChoice, choose_kernel, device_of, kernel_for

ALL = frozenset({"flash", "efficient", "cudnn"})
H100 = Device("cuda", (9, 0), ALL)
A10 = Device("cuda", (8, 6), ALL)
T4 = Device("cuda", (7, 5), ALL)
P100 = Device("cuda", (6, 0), ALL)
CPU = Device("cpu", None, frozenset({"flash"}))
BF16, FP16, FP32, FP64 = torch.bfloat16, torch.float16, torch.float32, torch.float64

# (device, dtype, head size, options, kernel, heads repeated, a phrase of the reason)
CASES = [
    # CPU: torch's fused flash kernel wherever it takes the block
    (CPU, FP32, 64, {}, "flash_cpu", False, "fp32, head size 64 on cpu"),
    (CPU, BF16, 7, {"gqa": True}, "flash_cpu", False, "grouped-query heads"),
    (CPU, FP64, 64, {}, "flash_cpu", False, "fp64"),
    (CPU, FP16, 64, {}, "flash_cpu", False, "fp16"),
    (CPU, torch.complex64, 64, {}, "math", False, "flash_cpu: no complex64"),
    (CPU, FP32, 64, {"value_head_dim": 32}, "math", False, "value head size 32 != head size 64"),
    (Device("cpu"), FP32, 64, {}, "math", False, "flash_cpu: switched off"),
    # CUDA: flash first
    (H100, BF16, 128, {"gqa": True}, "flash", False, "bf16, head size 128 on cuda sm_90, grouped-query heads"),
    (H100, FP16, 256, {"causal": False}, "flash", False, "fp16"),
    (Device("cuda", (12, 1), ALL), BF16, 64, {}, "flash", False, "sm_121"),
    # ... then memory-efficient, key/value heads repeated for grouped-query attention
    (H100, FP32, 64, {"gqa": True}, "efficient", True, "grouped-query heads repeated"),
    (H100, BF16, 320, {}, "efficient", False, "flash: head sizes equal and <= 256, not 320"),
    (H100, BF16, 128, {"value_head_dim": 64}, "efficient", False, "flash: head sizes equal"),
    (A10, BF16, 200, {}, "efficient", False, "flash: no backward for head size 200 on sm_86"),
    (A10, BF16, 232, {}, "flash", False, "sm_86"),  # above 224 the backward exists again
    (T4, FP16, 64, {}, "efficient", False, "flash: needs sm80-sm121, not sm_75"),
    (P100, FP32, 3, {}, "efficient", False, "sm_60"),  # alignment 1 without tensor cores
    (H100, BF16, 64, {"q_len": 8, "kv_len": 16}, "efficient", False, "causal only on square blocks, not 8 x 16"),
    (H100, BF16, 64, {"q_len": 8, "kv_len": 16, "causal": False}, "flash", False, "bf16"),
    (Device("cuda", (9, 0), frozenset({"efficient", "cudnn"})), BF16, 64, {}, "efficient", False, "bf16"),
    # ... then cuDNN, where the memory-efficient kernel is switched off
    (Device("cuda", (9, 0), frozenset({"cudnn"})), BF16, 64, {"gqa": True}, "cudnn", True, "heads repeated"),
    (Device("cuda", (9, 0), frozenset({"cudnn"})), FP16, 128, {}, "cudnn", False, "fp16"),
    # ... and math where none applies, naming why each was refused
    (H100, FP64, 64, {}, "math", False, "flash: fp16 or bf16 only, not fp64; efficient: no fp64 on sm_90; cudnn:"),
    (T4, BF16, 64, {}, "math", False, "efficient: no bf16 on sm_75; cudnn: needs sm80-sm121, not sm_75"),
    (H100, FP32, 6, {}, "math", False, "efficient: head sizes multiples of 4, not 6"),
    (Device("cuda", (9, 0), frozenset({"efficient", "cudnn"})), BF16, 12, {}, "math", False, "multiples of 8, not 12"),
    (Device("cuda", (9, 0), frozenset({"cudnn"})), BF16, 192, {}, "math", False, "multiples of 8 up to 128"),
    (Device("cuda", (9, 0), frozenset({"cudnn"})), BF16, 64, {"kv_len": 1, "q_len": 1}, "math", False, "one key"),
    (Device("cuda", (9, 0)), BF16, 64, {}, "math", False, "cudnn: needs cuDNN >= 9, switched on"),
    (Device("cuda", (5, 2), frozenset({"cudnn"})), FP16, 64, {}, "math", False, "cudnn: needs sm80-sm121"),
    (Device("cuda", (4, 0), frozenset({"efficient"})), FP16, 64, {}, "math", False, "needs sm50-sm121, not sm_40"),
    (Device("cuda", (9, 0), frozenset({"cudnn"})), FP32, 64, {}, "math", False, "cudnn: fp16 or bf16 only, not fp32"),
    (Device("mps"), FP32, 64, {}, "math", False, "no fused kernel with log-sum-exp on mps"),
]


@pytest.mark.parametrize(("device", "dtype", "head_dim", "options", "kernel", "expand", "reason"), CASES)
def test_each_branch_of_the_kernel_choice(device, dtype, head_dim, options, kernel, expand, reason):
    block = {"causal": True, "q_len": 512, "kv_len": 512, "gqa": False, **options}
    choice = choose_kernel(device, dtype, head_dim, **block)
    assert (choice.kernel, choice.expand_heads) == (kernel, expand), choice
    assert reason in choice.reason, choice.reason


def test_the_cases_reach_every_kernel():
    assert {case[4] for case in CASES} == {"flash_cpu", "flash", "efficient", "cudnn", "math"}


def test_the_device_as_read_from_torch_follows_sdpa_kernel():
    """On CPU the flash switch torch's ``sdpa_kernel`` sets decides between the fused kernel and math; other
    device types have no fused kernel with log-sum-exp."""
    assert device_of(torch.device("cpu")) == Device("cpu", None, frozenset({"flash"}))
    with sdpa_kernel(SDPBackend.MATH):
        assert device_of(torch.device("cpu")) == Device("cpu", None, frozenset())
        q = torch.randn(1, 2, 4, 8)
        assert kernel_for(q, q, q, causal=True).kernel == "math"
    assert device_of(torch.device("meta")) == Device("meta")
    q = torch.randn(1, 4, 4, 8)
    k = torch.randn(1, 2, 4, 8)
    assert kernel_for(q, k, k, causal=False) == KernelChoice(
        "flash_cpu", False, "fp32, head size 8 on cpu, grouped-query heads"
    )


def test_the_choice_is_logged_once_per_kind_of_block(caplog, monkeypatch):
    monkeypatch.setattr(kernels, "_logged", set())
    lightning_log = logging.getLogger("lightning.pytorch.utilities.rank_zero")  # printed like Lightning's own info
    monkeypatch.setattr(lightning_log, "propagate", False)  # seen once, whether Lightning's loggers propagate or not
    # Whatever tests ran before in this process: rank 0 of its run, Lightning's info shown.
    monkeypatch.setattr(rank_zero_only, "rank", 0)
    monkeypatch.setattr(lightning_log, "level", logging.INFO)
    monkeypatch.setattr(lightning_log, "disabled", False)
    lightning_log.addHandler(caplog.handler)
    try:
        q = torch.randn(1, 2, 4, 8)
        for _ in range(3):
            kernel_for(q, q, q, causal=True)
        kernel_for(q.double(), q.double(), q.double(), causal=True)
        meta = q.to("meta")
        assert kernel_for(meta, meta, meta, causal=True).kernel == "math"  # shapes alone: not logged
    finally:
        lightning_log.removeHandler(caplog.handler)
    lines = [r.getMessage() for r in caplog.records if "Context-parallel attention" in r.getMessage()]
    assert lines == [
        "Context-parallel attention blocks run on flash_cpu (aten._scaled_dot_product_flash_attention_for_cpu):"
        " fp32, head size 8 on cpu.",
        "Context-parallel attention blocks run on flash_cpu (aten._scaled_dot_product_flash_attention_for_cpu):"
        " fp64, head size 8 on cpu.",
    ]
