"""torch's ``nn.MultiheadAttention`` sharded by heads ('multihead_attention'): outputs, attention weights and every
gradient as the whole module computes them, over the module's options (one tp=2 job)."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import nn

from tests.helpers.distributed import run_distributed

E, HEADS, T, S, B = 8, 4, 5, 6, 3

CASES: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {  # (module options, call options)
    "self-attention, batch first": ({"batch_first": True}, {}),
    "self-attention, sequence first, no weights": ({}, {"need_weights": False}),
    "causal mask, is_causal": ({"batch_first": True}, {"need_weights": False, "causal": True}),
    "cross-attention to one memory": ({"batch_first": True}, {"cross": True}),
    "cross-attention, keys and values apart": ({}, {"cross": True, "apart": True, "need_weights": False}),
    "other key/value widths": ({"kdim": 6, "vdim": 7}, {"cross": True, "apart": True}),
    "no bias, per-head weights": ({"bias": False}, {"average_attn_weights": False}),
    "bias_k/v, zero attention, padding": ({"add_bias_kv": True, "add_zero_attn": True}, {"padding": True}),
    "per-head 3-d mask": ({"batch_first": True}, {"mask3d": True, "need_weights": False}),
    "unbatched": ({}, {"unbatched": True}),
}


def _inputs(options: dict[str, Any], module_options: dict[str, Any]) -> tuple[tuple, dict]:
    g = torch.Generator().manual_seed(1)
    first = module_options.get("batch_first", False)
    shape = lambda length, width: (B, length, width) if first else (length, B, width)
    if options.get("unbatched"):
        shape = lambda length, width: (length, width)
    query = torch.randn(shape(T, E), generator=g, requires_grad=True)
    if not options.get("cross"):
        return (query, query, query), {}
    key = torch.randn(shape(S, module_options.get("kdim", E)), generator=g, requires_grad=True)
    value = key
    if options.get("apart"):
        value = torch.randn(shape(S, module_options.get("vdim", E)), generator=g, requires_grad=True)
    return (query, key, value), {}


def _call(module: nn.Module, inputs: tuple, options: dict[str, Any]) -> tuple:
    kwargs: dict[str, Any] = {}
    for name in ("need_weights", "average_attn_weights"):
        if name in options:
            kwargs[name] = options[name]
    length = inputs[1].shape[1 if module.batch_first else 0]
    if options.get("causal"):
        kwargs.update(attn_mask=nn.Transformer.generate_square_subsequent_mask(T), is_causal=True)
    if options.get("padding"):
        padding = torch.zeros(B, length, dtype=torch.bool)
        padding[0, -2:] = True
        kwargs["key_padding_mask"] = padding
    if options.get("mask3d"):
        kwargs["attn_mask"] = torch.randn(B * HEADS, T, length, generator=torch.Generator().manual_seed(2))
    return module(*inputs, **kwargs)


def _worker() -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    from lightning_mgpu.parallel.tensor.sharding import apply as apply_tensor_parallel

    torch.distributed.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    problems: dict[str, str] = {}
    for name, (module_options, call_options) in CASES.items():
        torch.manual_seed(0)
        holder = nn.Module()
        holder.attention = nn.MultiheadAttention(E, HEADS, **module_options)
        reference = copy.deepcopy(holder.attention)
        apply_tensor_parallel(holder, mesh, {"attention": "multihead_attention"}, sequence_parallel=False)
        try:
            results = []
            for module in (reference, holder.attention):
                inputs, _ = _inputs(call_options, module_options)
                output, weights = _call(module, inputs, call_options)
                loss = output.square().sum() + (weights.sum() if weights is not None else 0)
                loss.backward()
                grads = {
                    n: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad)
                    for n, p in module.named_parameters()
                }
                results.append((output, weights, [x.grad for x in dict.fromkeys(inputs)], grads))
            (out, w, xg, pg), (tp_out, tp_w, tp_xg, tp_pg) = results
            torch.testing.assert_close(tp_out, out, msg=lambda m: f"output: {m}")
            if w is not None:
                torch.testing.assert_close(tp_w, w, msg=lambda m: f"weights: {m}")
            for a, b in zip(tp_xg, xg, strict=True):
                torch.testing.assert_close(a, b, msg=lambda m: f"input gradient: {m}")
            assert pg.keys() == tp_pg.keys()
            for key, value in pg.items():
                torch.testing.assert_close(tp_pg[key], value, msg=lambda m, key=key: f"{key} gradient: {m}")
            sharded = {n for n, p in holder.attention.named_parameters() if not p.placements[0].is_replicate()}
            assert sharded >= {"out_proj.weight"} and (sharded & {"in_proj_weight", "q_proj_weight"}), sharded
        except Exception as error:  # every case reported, not just the first
            problems[name] = f"{type(error).__name__}: {error}"
    return problems


@pytest.fixture(scope="module")
def problems() -> dict[str, str]:
    outcomes = run_distributed(_worker, 2)
    return {name: problem for outcome in outcomes for name, problem in outcome.items()}


@pytest.mark.parametrize("case", list(CASES))
def test_sharded_by_heads_computes_what_the_whole_module_computes(case, problems):
    assert case not in problems, problems[case]
