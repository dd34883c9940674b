"""Optimizer steps on local shards: bit-identical to the DTensor step (fused where the local step fuses), state left
as DTensors, undone by remove."""

from __future__ import annotations

import torch
from torch import nn

from lightning_mgpu.parallel.local_step import ShardLocalStep, steps_on_shards
from tests.helpers.distributed import run_distributed


def _sharded_model(mesh):
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 10), nn.LayerNorm(10), nn.Linear(10, 3))
    for layer in model:
        fully_shard(layer, mesh=mesh)
    return model


def _train(make_optimizer, local: bool, steps: int = 3, replicated_grad: bool = False, fused: bool = False):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    model = _sharded_model(mesh)
    optimizer = make_optimizer(model.parameters())
    wrapper = ShardLocalStep(optimizer) if local else None
    torch.manual_seed(1 + dist.get_rank())
    for _ in range(steps):
        loss = model(torch.randn(4, 6)).square().mean()
        optimizer.zero_grad()
        loss.backward()
        if replicated_grad:  # a gradient laid out unlike its parameter: the step must stay on the DTensors
            weight = model[0].weight
            weight.grad = weight.grad.redistribute(placements=[Replicate()])
        for group in optimizer.param_groups if fused else ():  # what the local step runs for classes left to choose
            group["fused"] = True
        optimizer.step()
        for group in optimizer.param_groups if fused else ():
            group["fused"] = None
    state = {
        (i, key): (type(value).__name__, getattr(value, "placements", None), _local(value).clone())
        for i, p in enumerate(model.parameters())
        for key, value in optimizer.state[p].items()
    }
    if wrapper is not None:
        wrapper.remove()
        assert "step" not in vars(optimizer)  # the class's own step again
    params = [p.to_local().detach().clone() for p in model.parameters()]
    assert all(isinstance(p, DTensor) for p in model.parameters())
    return params, state, optimizer.state_dict()["param_groups"]


def _local(value):
    from torch.distributed.tensor import DTensor

    return value.to_local() if isinstance(value, DTensor) else value


def _compare(make_optimizer, replicated_grad: bool = False, fused: bool = False):
    reference = _train(make_optimizer, local=False, replicated_grad=replicated_grad, fused=fused)
    local = _train(make_optimizer, local=True, replicated_grad=replicated_grad)
    for a, b in zip(reference[0], local[0]):
        assert torch.equal(a, b)
    assert reference[1].keys() == local[1].keys() and reference[1]
    for key, (kind, placements, value) in reference[1].items():
        assert local[1][key][:2] == (kind, placements), key
        assert torch.equal(local[1][key][2], value), key
    assert reference[2] == local[2]


def _job():
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo")
    # foreach/fused left unset: on CPU the local step runs torch's fused kernel (the DTensor reference too, to compare)
    _compare(lambda params: torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1), fused=True)
    _compare(lambda params: torch.optim.SGD(params, lr=1e-2, momentum=0.9, nesterov=True))  # not fused
    _compare(lambda params: torch.optim.AdamW(params, lr=1e-2, foreach=False))  # the user's choice: not fused
    _compare(lambda params: torch.optim.Adam(params, lr=1e-2, amsgrad=True, foreach=True))
    _compare(lambda params: torch.optim.AdamW(params, lr=1e-2), replicated_grad=True)
    mesh_params = list(_sharded_model(init_device_mesh("cpu", (2,))).parameters())
    assert steps_on_shards(torch.optim.AdamW(mesh_params))
    assert not steps_on_shards(torch.optim.Adafactor(mesh_params))  # norm-based: the DTensor step reduces over shards
    assert not steps_on_shards(torch.optim.AdamW(nn.Linear(2, 2).parameters()))  # nothing sharded


def test_local_step_matches_dtensor_step():
    run_distributed(_job, 2)
