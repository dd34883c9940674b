"""Ring and all-to-all attention against torch's SDPA on the whole sequence: outputs and gradients."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from lightning_mgpu.parallel.context import alltoall_attention, ring_attention, shard_sequence, unshard_sequence
from lightning_mgpu.parallel.context.attention import (
    _attention,
    _attention_backward,
    _math_attention,
    _math_attention_backward,
)
from tests.helpers.distributed import run_distributed

CASES = [(mode, causal, kv_heads) for mode in ("ring", "alltoall") for causal in (True, False) for kv_heads in (4, 2)]


def _compare(world: int) -> dict:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    results = {}
    for mode, causal, kv_heads in CASES:
        g = torch.Generator().manual_seed(0)
        q, k, v = (torch.randn(2, h, 16, 8, generator=g, requires_grad=True) for h in (4, kv_heads, kv_heads))
        grad = torch.randn(2, 4, 16, 8, generator=g)
        expected = F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=kv_heads != 4)
        expected.backward(grad)
        local = [shard_sequence(t.detach(), 2, world, rank).requires_grad_() for t in (q, k, v)]
        if mode == "ring":
            out = ring_attention(*local, causal, None, dist.group.WORLD)
        else:
            out = alltoall_attention(*local, causal, None, dist.group.WORLD, F.scaled_dot_product_attention)
        out.backward(shard_sequence(grad, 2, world, rank))
        errors = {}
        for name, mine, whole in zip(
            ("out", "dq", "dk", "dv"), (out, *(t.grad for t in local)), (expected, q.grad, k.grad, v.grad)
        ):
            shards = [torch.empty_like(mine) for _ in range(world)]
            dist.all_gather(shards, mine.detach().contiguous())
            errors[name] = float((unshard_sequence(shards, 2) - whole).abs().max())
        results[(mode, causal, kv_heads)] = errors
    return results


@pytest.mark.parametrize("world", [2, 4])
def test_ring_and_alltoall_equal_attention_on_the_whole_sequence(world):
    """Causal and not, grouped-query (2 key/value heads for 4 query heads) and not: fp32 to 1e-5."""
    results = run_distributed(_compare, world, world)
    for rank_results in results:
        for case, errors in rank_results.items():
            assert max(errors.values()) < 1e-5, (world, case, errors)


def test_the_math_kernels_other_devices_use_equal_torchs_cpu_kernels():
    """Off CPU the ring computes each block with the same math in torch ops (no fused kernel with log-sum-exp is
    public there): its output, log-sum-exp and gradients equal the CPU kernel's, causal and grouped-query."""
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
