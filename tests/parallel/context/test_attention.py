"""Ring and all-to-all attention against torch's SDPA on the whole sequence: outputs and gradients."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from lightning_mgpu.parallel.context import alltoall_attention, ring_attention, shard_sequence, unshard_sequence
from lightning_mgpu.parallel.context import attention as attention_module
from lightning_mgpu.parallel.context.attention import (
    _attention,
    _attention_backward,
    _math_attention,
    _math_attention_backward,
    block_attention,
)
from lightning_mgpu.parallel.context.kernels import KernelChoice
from tests.helpers.distributed import run_distributed

CASES = [(mode, causal, kv_heads) for mode in ("ring", "alltoall") for causal in (True, False) for kv_heads in (4, 2)]


def _errors(mode: str, causal: bool, kv_heads: int, world: int, rank: int, sdpa) -> dict:
    """The largest difference of the output and each gradient from SDPA on the whole sequence; ``sdpa``: what the
    all-to-all runs on the gathered sequence."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, h, 16, 8, generator=g, requires_grad=True) for h in (4, kv_heads, kv_heads))
    grad = torch.randn(2, 4, 16, 8, generator=g)
    expected = F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=kv_heads != 4)
    expected.backward(grad)
    local = [shard_sequence(t.detach(), 2, world, rank).requires_grad_() for t in (q, k, v)]
    if mode == "ring":
        out = ring_attention(*local, causal, None, dist.group.WORLD)
    else:
        out = alltoall_attention(*local, causal, None, dist.group.WORLD, sdpa)
    out.backward(shard_sequence(grad, 2, world, rank))
    errors = {}
    for name, mine, whole in zip(
        ("out", "dq", "dk", "dv"), (out, *(t.grad for t in local)), (expected, q.grad, k.grad, v.grad)
    ):
        shards = [torch.empty_like(mine) for _ in range(world)]
        dist.all_gather(shards, mine.detach().contiguous())
        errors[name] = float((unshard_sequence(shards, 2) - whole).abs().max())
    return errors


def _compare(world: int) -> dict:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    return {case: _errors(*case, world, rank, F.scaled_dot_product_attention) for case in CASES}


@pytest.mark.parametrize("world", [2, 4])
def test_ring_and_alltoall_equal_attention_on_the_whole_sequence(world):
    """Causal and not, grouped-query (2 key/value heads for 4 query heads) and not: fp32 to 1e-5."""
    results = run_distributed(_compare, world, world)
    for rank_results in results:
        for case, errors in rank_results.items():
            assert max(errors.values()) < 1e-5, (world, case, errors)


def test_a_ring_of_one_rank_is_its_block_kernel_and_merge():
    """cp 1 (what the GPU check runs on one device): the ring's two chunks per rank, merged by their log-sum-exp,
    without a transfer."""
    for errors in run_distributed(_compare, 1, 1)[0].values():
        assert max(errors.values()) < 1e-5, errors


def test_the_math_kernels_other_devices_use_equal_torchs_cpu_kernels():
    """Where no fused kernel takes a block (``kernels.choose_kernel``), the ring computes it with the same math in
    torch ops: its output, log-sum-exp and gradients equal the CPU kernel's, causal and grouped-query."""
    g = torch.Generator().manual_seed(1)
    for causal in (True, False):
        q, k, v = (
            torch.randn(2, 4, 8, 16, generator=g),
            torch.randn(2, 2, 8, 16, generator=g),
            torch.randn(2, 2, 8, 16, generator=g),
        )
        grad = torch.randn(2, 4, 8, 16, generator=g)
        out, lse = _attention(q, k, v, causal, 0.3)
        math_out, math_lse = _math_attention(q, k, v, causal, 0.3)
        torch.testing.assert_close(math_out, out, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(math_lse, lse, rtol=1e-5, atol=1e-6)
        fused = _attention_backward(grad, q, k, v, out, lse, causal, 0.3)
        math = _math_attention_backward(grad, q, k, v, out, lse, causal, 0.3)
        for a, b in zip(math, fused):
            torch.testing.assert_close(a, b.float(), rtol=1e-4, atol=1e-5)


# ------------------------------------------------------------------------- the shared block kernel, each route
ROUTES = ("chosen", "heads repeated", "math")


@contextlib.contextmanager
def _route(name: str):
    """``chosen``: the kernel ``kernel_for`` picks here (torch's fused CPU flash kernel); ``heads repeated``: the same
    kernel with grouped key/value heads repeated and their gradients folded, as the CUDA memory-efficient and cuDNN
    kernels get them; ``math``: what ``sdpa_kernel(MATH)`` leaves, the math in torch ops."""
    if name == "math":
        with sdpa_kernel(SDPBackend.MATH):
            yield
        return
    chosen = attention_module.kernel_for
    if name == "heads repeated":
        attention_module.kernel_for = lambda q, k, v, causal: KernelChoice("flash_cpu", k.shape[1] != q.shape[1], "")
    try:
        yield
    finally:
        attention_module.kernel_for = chosen


def _compare_routes(world: int) -> dict:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    results = {}
    for route in ROUTES:
        with _route(route):
            for case in CASES:
                results[(route, *case)] = _errors(*case, world, rank, block_attention)
    return results


def test_ring_and_alltoall_through_the_shared_block_kernel_on_each_route():
    """Ring and all-to-all (its whole-sequence attention on ``block_attention``, as training runs it), causal and not,
    grouped-query heads and not, through the fused CPU kernel, with heads repeated, and through math: fp32 to 1e-5
    of torch's SDPA on the whole sequence."""
    results = run_distributed(_compare_routes, 2, 2)
    for rank_results in results:
        assert len(rank_results) == len(ROUTES) * len(CASES)
        for case, errors in rank_results.items():
            assert max(errors.values()) < 1e-5, (case, errors)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_block_attention_equals_sdpa_forward_and_backward(dtype):
    """One process: the all-to-all's block attention against SDPA, grouped-query heads, causal and not, in the
    inputs' dtype (equal on CPU, where SDPA picks the same fused kernel; the tolerance is bf16's rounding)."""
    tolerance = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}
    g = torch.Generator().manual_seed(3)
    for causal in (True, False):
        q, k, v = (torch.randn(2, h, 24, 16, generator=g).to(dtype).requires_grad_() for h in (8, 2, 2))
        grad = torch.randn(2, 8, 24, 16, generator=g).to(dtype)
        expected = F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)
        wanted = torch.autograd.grad(expected, (q, k, v), grad)
        out = block_attention(q, k, v, is_causal=causal)
        got = torch.autograd.grad(out, (q, k, v), grad)
        torch.testing.assert_close(out, expected, **tolerance)
        for mine, theirs in zip(got, wanted):
            assert mine.dtype == dtype
            torch.testing.assert_close(mine, theirs, **tolerance)


def test_value_heads_of_another_size_run_the_math_path():
    """Queries and keys of head size 16, values of 8 (DeepSeek-style): torch's fused CPU kernel refuses them, the
    block runs the math path, equal to SDPA forward and backward."""
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(2, 4, 8, d, generator=g, requires_grad=True) for d in (16, 16, 8))
    grad = torch.randn(2, 4, 8, 8, generator=g)
    expected = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    out = block_attention(q, k, v, is_causal=True)
    torch.testing.assert_close(out, expected)
    for mine, theirs in zip(torch.autograd.grad(out, (q, k, v), grad), torch.autograd.grad(expected, (q, k, v), grad)):
        torch.testing.assert_close(mine, theirs)


def test_the_math_path_stays_fp32_under_autocast():
    """A bf16-mixed step runs attention under autocast, which casts matmuls to bf16: the math path's scores,
    output and gradients are computed in fp32 all the same."""
    g = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(1, 4, 16, 8, generator=g) for _ in range(3))
    grad = torch.randn(1, 4, 16, 8, generator=g)
    out, lse = _math_attention(q, k, v, True, None)
    grads = _math_attention_backward(grad, q, k, v, out, lse, True, None)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out_mixed, lse_mixed = _math_attention(q, k, v, True, None)
        grads_mixed = _math_attention_backward(grad, q, k, v, out, lse, True, None)
    assert torch.equal(out, out_mixed) and torch.equal(lse, lse_mixed)
    assert all(torch.equal(a, b) for a, b in zip(grads, grads_mixed))
