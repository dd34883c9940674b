"""What a step does (samples, tokens, FLOPs), what the device could do (peak FLOP/s), and memory per rank."""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, TypedDict

import torch
from torch import nn

from lightning_mgpu.gpus import gpu_named

if TYPE_CHECKING:
    from lightning.pytorch.core.optimizer import LightningOptimizer
    from torch.optim import Optimizer


def device_peak_flops(device: torch.device, precision: str) -> tuple[float | None, str]:
    """Peak FLOP/s of one device for ``precision`` and where the number comes from.

    CUDA devices are looked up in the table of GPUs (``lightning_mgpu.gpus``); a CPU process (or an unknown GPU) is
    measured with a square matmul in the training dtype on its own threads, which is what a CPU rank can reach at
    best.
    """
    half = "16" in str(precision)
    if device.type == "cuda" and torch.cuda.is_available():
        gpu = gpu_named(torch.cuda.get_device_name(device))
        if gpu is not None:
            return gpu.peak_flops(half, torch.backends.cuda.matmul.allow_tf32), f"table: {gpu.device_name}"
    dtype = torch.bfloat16 if "bf16" in str(precision) else torch.float32
    return _measured_matmul_flops(device, dtype), f"measured: {dtype} matmul on {device.type}"


def _measured_matmul_flops(device: torch.device, dtype: torch.dtype, n: int = 512, repeats: int = 4) -> float:
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    best = float("inf")
    for _ in range(repeats + 1):  # the first one warms up
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        torch.mm(a, b)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - start)
    return 2 * n**3 / best


def batch_size_and_tokens(batch: object) -> tuple[int, int]:
    """Samples in ``batch`` (dim 0 of its first tensor) and tokens (elements of its first integer tensor with a
    sequence dimension; otherwise one per sample)."""
    from lightning_mgpu._compat.tensors import tree_leaves

    tensors = [t for t in tree_leaves(batch) if torch.is_tensor(t) and t.dim() > 0]
    if not tensors:
        return 0, 0
    samples = int(tensors[0].shape[0])
    for tensor in tensors:
        if tensor.dim() >= 2 and not tensor.is_floating_point() and not tensor.is_complex():
            return samples, int(tensor.shape[0] * tensor.shape[1])
    return samples, samples


def parameters_held(module: nn.Module) -> int:
    """Parameters this rank's model holds, counted at their full (unsharded) size: a DTensor counts globally."""
    return sum(p.numel() for p in module.parameters())


def local_bytes(tensor: torch.Tensor) -> int:
    """Bytes this rank stores for ``tensor`` (its local shard when it is a DTensor)."""
    local = _local(tensor)
    return local.numel() * local.element_size() if torch.is_tensor(local) else 0


def model_bytes(module: nn.Module, optimizers: Sequence[Optimizer | LightningOptimizer]) -> dict[str, int]:
    """Bytes of parameters, gradients and optimizer state on this rank."""
    params = list(module.parameters())
    optimizer_state = 0
    for optimizer in optimizers:
        optimizer = getattr(optimizer, "optimizer", optimizer)  # a LightningOptimizer wraps the user's
        for state in optimizer.state.values():
            optimizer_state += sum(local_bytes(v) for v in state.values() if torch.is_tensor(v))
    return {
        "parameters": sum(local_bytes(p) for p in params),
        "gradients": sum(local_bytes(p.grad) for p in params if p.grad is not None),
        "optimizer": optimizer_state,
    }


class PeakMemory(TypedDict):
    peak: int
    peak_kind: str
    capacity: int


def peak_and_capacity(device: torch.device, local_processes: int) -> PeakMemory:
    """Peak memory of this rank and what it may use: the GPU's, or the host's RAM shared by its local ranks."""
    if device.type == "cuda" and torch.cuda.is_available():
        return {
            "peak": int(torch.cuda.max_memory_allocated(device)),
            "peak_kind": "cuda max_memory_allocated",
            "capacity": int(torch.cuda.get_device_properties(device).total_memory),
        }
    import resource

    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return {
        "peak": int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024,
        "peak_kind": "process peak RSS",
        "capacity": int(total // max(1, local_processes)),
    }


class SavedActivations(AbstractContextManager):
    """Counts the bytes autograd saves for backward (activations), each storage once, parameters excluded.

    Tensors that activation checkpointing recomputes are not saved, so they are not counted, as it should be.
    """

    def __init__(self, module: nn.Module) -> None:
        self._exclude = {_storage_key(p) for p in module.parameters()}
        self._seen: set[int] = set()
        self.bytes = 0
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack)

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        try:
            key = _storage_key(tensor)
            if key not in self._seen and key not in self._exclude:
                self._seen.add(key)
                self.bytes += local_bytes(tensor)
        except Exception:  # a tensor without storage (meta, functional wrappers): nothing to count
            pass
        return tensor

    def __enter__(self) -> SavedActivations:
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._hooks.__exit__(*exc)


def _storage_key(tensor: torch.Tensor) -> int:
    return _local(tensor).untyped_storage().data_ptr()


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (without autograd: ``to_local`` under no_grad is the stored tensor itself)."""
    from torch.distributed.tensor import DTensor

    if not isinstance(tensor, DTensor):
        return tensor
    with torch.no_grad():
        return tensor.to_local()


def _unpack(tensor: torch.Tensor) -> torch.Tensor:
    return tensor
