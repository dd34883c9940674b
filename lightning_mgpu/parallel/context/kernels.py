"""Which kernel computes one attention block of context parallelism, and why.

Ring attention needs each block's log-sum-exp and a backward given the merged output and log-sum-exp, so it calls
torch's fused attention operators directly (``_compat/attention.py``) instead of ``F.scaled_dot_product_attention``,
and has to choose among them as SDPA would: :func:`choose_kernel`, a pure function of the device (type, CUDA
capability, the kernels torch has and allows now) and the block (dtype, head sizes, causal mask, sequence lengths,
grouped-query heads). The constraints are torch 2.13's own (``aten/src/ATen/native/transformers/cuda/sdp_utils.cpp``
and ``sdp_utils_cpp.cpp``), in the order torch's context parallelism prefers (flash first); the math path in torch
ops (an fp32 ``T x T`` score matrix per head) runs only where none applies. The choice is logged once per kind of
block (:func:`kernel_for`).

========  ===========  ===============================================================================================
device    kernel       when
========  ===========  ===============================================================================================
cpu       flash_cpu    flash enabled; fp32, fp64, bf16 or fp16; query, key and value head sizes equal
cuda      flash        flash built and enabled; sm80-sm121; fp16 or bf16; head sizes equal and <= 256 (not in
                       (192, 224] on sm86-89 and sm120-121, whose backward lacks it); causal only on square blocks
cuda      efficient    enabled; sm50-sm121; fp16 or fp32, bf16 from sm80; head sizes multiples of 8 (16-bit dtypes)
                       or 4 (fp32 from sm80); key/value heads repeated to the query heads' count
cuda      cudnn        cuDNN >= 9 and enabled, not under deterministic algorithms; sm80-sm121; fp16 or bf16; head
                       sizes multiples of 8 and <= 128; more than one key; key/value heads repeated
any       math         where none of the above applies (and on other devices)
========  ===========  ===============================================================================================

"Enabled" is torch's switch for the kernel (``torch.backends.cuda.enable_flash_sdp`` and its peers, which
``torch.nn.attention.sdpa_kernel`` sets), read at each call: turning a kernel off for SDPA turns it off here.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Literal

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_info

Kernel = Literal["flash_cpu", "flash", "efficient", "cudnn", "math"]
# Kernels that take fewer key/value heads than query heads; the others get them repeated (and their gradients summed).
_NATIVE_GQA: frozenset[str] = frozenset({"flash_cpu", "flash"})
_CANDIDATES: dict[str, tuple[Kernel, ...]] = {"cpu": ("flash_cpu",), "cuda": ("flash", "efficient", "cudnn")}
_CPU_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)
_HALF = (torch.float16, torch.bfloat16)
_DESCRIPTIONS = {
    "flash_cpu": "aten._scaled_dot_product_flash_attention_for_cpu",
    "flash": "aten._scaled_dot_product_flash_attention",
    "efficient": "aten._scaled_dot_product_efficient_attention",
    "cudnn": "aten._scaled_dot_product_cudnn_attention",
    "math": "torch ops, an fp32 score matrix per head",
}
_logged: set[KernelChoice] = set()  # the choices logged so far


@dataclass(frozen=True)
class Device:
    """What the choice reads of a device: its type, a CUDA device's compute capability, and the fused kernels this
    torch has for it and allows now (``"flash"``, ``"efficient"``, ``"cudnn"``)."""

    type: str
    capability: tuple[int, int] | None = None
    enabled: frozenset[str] = field(default_factory=frozenset)

    def describe(self) -> str:
        return f"{self.type} sm_{self.capability[0]}{self.capability[1]}" if self.capability else self.type


@dataclass(frozen=True)
class KernelChoice:
    """The kernel for a block; ``expand_heads``: its key/value heads are repeated to the query heads' count first
    (grouped-query attention on a kernel without it); ``reason``: why this one (for math: why not each other)."""

    kernel: Kernel
    expand_heads: bool
    reason: str


@dataclass(frozen=True)
class _Block:
    dtype: torch.dtype
    head_dim: int
    value_head_dim: int
    causal: bool
    q_len: int
    kv_len: int


def choose_kernel(
    device: Device,
    dtype: torch.dtype,
    head_dim: int,
    *,
    value_head_dim: int | None = None,
    causal: bool,
    q_len: int,
    kv_len: int,
    gqa: bool,
) -> KernelChoice:
    """The kernel for one block (see the module's table): the first fused kernel of the device's that takes it,
    else math. The reason names the block and why each kernel before the chosen one was refused."""
    block = _Block(dtype, head_dim, head_dim if value_head_dim is None else value_head_dim, causal, q_len, kv_len)
    refusals: list[str] = []
    for kernel in _CANDIDATES.get(device.type, ()):
        why = _REFUSALS[kernel](device, block)
        if why is None:
            expand = gqa and kernel not in _NATIVE_GQA
            reason = f"{_dtype_name(dtype)}, head size {head_dim} on {device.describe()}"
            if gqa:
                reason += ", grouped-query heads" + (" repeated" if expand else "")
            if refusals:
                reason += f" ({'; '.join(refusals)})"
            return KernelChoice(kernel, expand, reason)
        refusals.append(f"{kernel}: {why}")
    return KernelChoice("math", False, "; ".join(refusals) or f"no fused kernel with log-sum-exp on {device.type}")


def kernel_for(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, causal: bool) -> KernelChoice:
    """The choice for these tensors on their device now; logged once per kind of block (not for shapes alone:
    meta tensors compute nothing)."""
    choice = choose_kernel(
        device_of(query.device), query.dtype, query.shape[-1], value_head_dim=value.shape[-1], causal=causal,
        q_len=query.shape[2], kv_len=key.shape[2], gqa=key.shape[1] != query.shape[1],
    )  # fmt: skip
    if choice not in _logged and query.device.type != "meta":
        _logged.add(choice)
        rank_zero_info(
            f"Context-parallel attention blocks run on {choice.kernel} ({_DESCRIPTIONS[choice.kernel]}):"
            f" {choice.reason}."
        )
    return choice


def device_of(device: torch.device) -> Device:
    """``device`` as the choice reads it: the capability of a CUDA device and torch's switches, read now."""
    if device.type == "cpu":
        return Device("cpu", None, frozenset({"flash"} if torch.backends.cuda.flash_sdp_enabled() else ()))
    if device.type != "cuda":
        return Device(device.type)
    enabled = set()
    if torch.backends.cuda.is_flash_attention_available() and torch.backends.cuda.flash_sdp_enabled():
        enabled.add("flash")
    if torch.backends.cuda.mem_efficient_sdp_enabled():
        enabled.add("efficient")
    deterministic = torch.are_deterministic_algorithms_enabled()
    deterministic = deterministic and not torch.is_deterministic_algorithms_warn_only_enabled()
    if _cudnn_version() >= 90000 and torch.backends.cuda.cudnn_sdp_enabled() and not deterministic:
        enabled.add("cudnn")
    return Device("cuda", _capability(device.index), frozenset(enabled))


@functools.cache
def _capability(index: int | None) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


@functools.cache
def _cudnn_version() -> int:
    return (torch.backends.cudnn.version() or 0) if torch.backends.cudnn.is_available() else 0


# --------------------------------------------------------------------------------- each kernel's constraints
def _flash_cpu(device: Device, block: _Block) -> str | None:
    if "flash" not in device.enabled:
        return "switched off (torch.backends.cuda.enable_flash_sdp / sdpa_kernel)"
    if block.dtype not in _CPU_DTYPES:
        return f"no {_dtype_name(block.dtype)}"
    if block.value_head_dim != block.head_dim:
        return f"value head size {block.value_head_dim} != head size {block.head_dim}"
    return None


def _flash(device: Device, block: _Block) -> str | None:
    capability = device.capability or (0, 0)
    if "flash" not in device.enabled:
        return "not built into this torch, or switched off (torch.backends.cuda.enable_flash_sdp / sdpa_kernel)"
    if not (8, 0) <= capability <= (12, 1):
        return f"needs sm80-sm121, not sm_{capability[0]}{capability[1]}"
    if block.dtype not in _HALF:
        return f"fp16 or bf16 only, not {_dtype_name(block.dtype)}"
    if block.value_head_dim != block.head_dim or block.head_dim > 256:
        return f"head sizes equal and <= 256, not {block.head_dim} and {block.value_head_dim}"
    narrow_backward = (8, 6) <= capability <= (8, 9) or (12, 0) <= capability <= (12, 1)
    if narrow_backward and 192 < block.head_dim <= 224:
        return f"no backward for head size {block.head_dim} on sm_{capability[0]}{capability[1]}"
    if block.causal and block.q_len != block.kv_len:
        return f"causal only on square blocks, not {block.q_len} x {block.kv_len}"
    return None


def _efficient(device: Device, block: _Block) -> str | None:
    capability = device.capability or (0, 0)
    if "efficient" not in device.enabled:
        return "switched off (torch.backends.cuda.enable_mem_efficient_sdp / sdpa_kernel)"
    if not (5, 0) <= capability <= (12, 1):
        return f"needs sm50-sm121, not sm_{capability[0]}{capability[1]}"
    dtypes = (torch.float16, torch.float32, torch.bfloat16) if capability >= (8, 0) else (torch.float16, torch.float32)
    if block.dtype not in dtypes:
        return f"no {_dtype_name(block.dtype)} on sm_{capability[0]}{capability[1]}"
    alignment = _efficient_alignment(block.dtype, capability)
    if block.head_dim % alignment or block.value_head_dim % alignment:
        return f"head sizes multiples of {alignment}, not {block.head_dim} and {block.value_head_dim}"
    return None


def _cudnn(device: Device, block: _Block) -> str | None:
    capability = device.capability or (0, 0)
    if "cudnn" not in device.enabled:
        return "needs cuDNN >= 9, switched on (torch.backends.cuda.enable_cudnn_sdp) and no deterministic algorithms"
    if not (8, 0) <= capability <= (12, 1):
        return f"needs sm80-sm121, not sm_{capability[0]}{capability[1]}"
    if block.dtype not in _HALF:
        return f"fp16 or bf16 only, not {_dtype_name(block.dtype)}"
    if any(d % 8 or d > 128 for d in (block.head_dim, block.value_head_dim)):
        return f"head sizes multiples of 8 up to 128, not {block.head_dim} and {block.value_head_dim}"
    if block.kv_len == 1:
        return "no blocks of one key"
    return None


_REFUSALS = {"flash_cpu": _flash_cpu, "flash": _flash, "efficient": _efficient, "cudnn": _cudnn}


def _efficient_alignment(dtype: torch.dtype, capability: tuple[int, int]) -> int:
    """The memory-efficient kernel's GEMM alignment in elements (sdp_utils.cpp's ``minimum_gemm_alignment``)."""
    if dtype in _HALF and capability >= (7, 0):
        return 8  # tensor cores: 128 bits
    return 4 if capability >= (8, 0) else 1


def _dtype_name(dtype: torch.dtype) -> str:
    return {torch.float32: "fp32", torch.float64: "fp64", torch.bfloat16: "bf16", torch.float16: "fp16"}.get(
        dtype, str(dtype).removeprefix("torch.")
    )
