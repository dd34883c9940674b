"""Per-head values of plain-shard attentions (``heads.py``), regions that mix the shards moved to global shapes
(``mixing.py``) and ``std`` over sharded features in a global-shape region (``region.py``).

The Hugging Face models they exist for (Doge, NeoMME, Gemma 3n) train under tp=2 like one process in
test_tensor_every_architecture.py; here, what is found on them, and the mechanisms on small modules.
"""

from __future__ import annotations

import os

import pytest
import torch
from torch import nn

from tests.helpers.distributed import run_distributed

pytest.importorskip("transformers")


def test_per_head_values_are_found_in_attentions_only():
    from lightning_mgpu.parallel.tensor.heads import per_head_outputs, per_head_parameters
    from lightning_mgpu.parallel.tensor.plan import _match, auto_plan
    from tests.parallel.tensor.test_every_architecture import _tiny_model

    def found(model_type: str) -> tuple[dict, list]:
        model = _tiny_model(model_type)
        matched = _match(model, auto_plan(model))
        attentions = {n for n, _ in model.named_modules() if n.endswith("self_attn")}
        mlps = {n for n, _ in model.named_modules() if n.endswith(".mlp")}
        return per_head_parameters(model, attentions | mlps, set(matched), 2), per_head_outputs(
            model, matched, attentions | mlps
        )

    layers = ("model.layers.0.self_attn", "model.layers.1.self_attn")
    assert found("doge") == ({n: ["A"] for n in layers}, [f"{n}.dt_proj" for n in layers])
    parameters, outputs = found("neomme")
    assert parameters == {f"{n}.exclusive_self_attention": ["alpha"] for n in layers} and outputs == []
    assert found("llama") == ({}, [])


class _ThresholdMLP(nn.Module):
    """Gemma 3n's activation sparsity in plain code: the gate kept where it exceeds the mean plus 1.645 standard
    deviations over all its features."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = nn.Linear(16, 32)
        self.up = nn.Linear(16, 32)
        self.down = nn.Linear(32, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate = self.gate(x)
        multiplier = torch.distributions.normal.Normal(0, 1).icdf(torch.tensor(0.95)).type(gate.dtype)
        spread = torch.std(gate, dim=-1, keepdim=True, unbiased=False) * multiplier
        gate = torch.relu(gate - (torch.mean(gate, dim=-1, keepdim=True) + spread))
        return self.down(nn.functional.gelu(gate) * self.up(x) * gate.var(-1, keepdim=True))


class _Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.mlp = _ThresholdMLP()


def _sharded_checks() -> dict[str, float]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    from lightning_mgpu.parallel.tensor.sharding import apply as apply_tensor_parallel
    from tests.parallel.tensor.test_every_architecture import _loss, _tiny_model

    rank = int(os.environ["RANK"])
    torch.distributed.init_process_group("gloo", rank=rank, world_size=2)
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    gaps = {}
    # std/var over sharded features in a global-shape region: forward and backward as unsharded.
    torch.manual_seed(0)
    model, x = _Model(), torch.randn(2, 4, 16)
    reference = _Model()
    reference.load_state_dict(model.state_dict())
    plan = {"mlp.gate": "colwise", "mlp.up": "colwise", "mlp.down": "rowwise"}
    apply_tensor_parallel(model, mesh, plan, sequence_parallel=False)
    model.mlp(x).square().sum().backward()
    reference.mlp(x).square().sum().backward()
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        grad = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
        gaps[f"grad {name}"] = float((grad - q.grad).abs().max() / q.grad.abs().max())
    # Gemma 3n: the MLP of its sparse layer (0) moves to global shapes, the dense layer's (1) keeps plain shards.
    gemma = _tiny_model("gemma3n")
    apply_tensor_parallel(gemma, mesh, "auto", sequence_parallel=False)
    seen = {}
    for index in (0, 1):
        down = gemma.model.layers[index].mlp.down_proj
        down.register_forward_pre_hook(  # before the style's own hook converts a plain shard
            lambda m, args, i=index: seen.__setitem__(i, isinstance(args[0], DTensor)), prepend=True
        )
    _loss(gemma, torch.zeros(1, 9, dtype=torch.long))
    gaps["layer 0 on global shapes"] = float(not seen[0])
    gaps["layer 1 on plain shards"] = float(seen[1])
    return gaps


def test_std_over_shards_and_mixing_regions_under_tp2():
    for gaps in run_distributed(_sharded_checks, 2, timeout=300):
        assert not {name: gap for name, gap in gaps.items() if gap > 1e-5}, gaps
