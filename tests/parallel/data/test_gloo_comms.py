"""The collectives FSDP2 units use on gloo: torch's reduce-scatter's and all-gather's results, at the analytic
volume (the reduce-scatter at half the traffic of torch's)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_mgpu.parallel.data.gloo_comms import AllToAllReduceScatter, BroadcastAllGather
from tests.helpers.distributed import run_distributed
from tests.helpers.probes import collectives_of


def _compare() -> dict:
    import torch.distributed as dist
    from torch.distributed import ReduceOp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.profiler import profile

    from lightning_mgpu.parallel.data.wrap import apply as apply_data_parallel

    dist.init_process_group("gloo")
    world, rank = dist.get_world_size(), dist.get_rank()
    group, comm = dist.group.WORLD, AllToAllReduceScatter()
    torch.manual_seed(rank)
    results = {}
    for dtype in (torch.float32, torch.bfloat16):
        # MAX: not a sum, left to torch's reduce-scatter.
        for name, op in (("sum", ReduceOp.SUM), ("avg", ReduceOp.AVG), ("max", ReduceOp.MAX)):
            full = torch.randn(world * 6, dtype=dtype)
            expected, got = torch.empty(6, dtype=dtype), comm.allocate((6,), dtype=dtype, device=full.device)
            dist.reduce_scatter_single(expected, full.clone(), group=group, op=op)
            comm(got, full.clone(), group, op)
            results[(str(dtype), name)] = (expected, got)
        # The gather: from a separate shard, from a shard already in place (as FSDP2 calls it), asynchronously
        # (left to torch's all-gather).
        shard, gather = torch.randn(5, dtype=dtype), BroadcastAllGather()
        expected = torch.empty(world * 5, dtype=dtype)
        dist.all_gather_into_tensor(expected, shard, group=group)
        got = gather.allocate((world * 5,), dtype=dtype, device=shard.device)
        assert gather(got, shard, group) is None
        in_place = torch.full((world * 5,), float("nan"), dtype=dtype)
        in_place[rank * 5 : (rank + 1) * 5] = shard
        gather(in_place, in_place[rank * 5 : (rank + 1) * 5], group)
        later = torch.empty(world * 5, dtype=dtype)
        gather(later, shard, group, async_op=True).wait()
        results[("gather", str(dtype))] = (expected, torch.stack([got, in_place, later]))
    # FSDP2 gathers parameters of mixed dtypes as bytes; a gather on a subgroup names its sources by group rank.
    raw = torch.randint(0, 256, (7,), dtype=torch.uint8)
    expected, got = torch.empty(world * 7, dtype=torch.uint8), torch.empty(world * 7, dtype=torch.uint8)
    dist.all_gather_into_tensor(expected, raw, group=group)
    BroadcastAllGather()(got, raw, group)
    results[("gather", "torch.uint8")] = (expected, got[None])
    subgroup = dist.new_group(list(range(1, world)))  # every rank takes part in creating it
    if rank >= 1 and world > 2:
        shard = torch.randn(3)
        expected, got = torch.empty(3 * (world - 1)), torch.empty(3 * (world - 1))
        dist.all_gather_into_tensor(expected, shard, group=subgroup)
        BroadcastAllGather()(got, shard, subgroup)
        results[("gather", "subgroup")] = (expected, got[None])

    # Installed on every sharded unit: each unit's gradients are reduced with one all-to-all, its parameters gathered
    # with one broadcast per rank.
    mesh = init_device_mesh("cpu", (world,))
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 2))
    apply_data_parallel(model, mesh, zero_stage=2, blocks=[model[0]])
    with profile(record_shapes=True) as prof:
        model(torch.randn(3, 8)).sum().backward()
    results["counted"] = collectives_of(prof, world)
    # A unit sharded by hand keeps torch's own collectives.
    plain = fully_shard(nn.Linear(8, 8), mesh=mesh)
    with profile(record_shapes=True) as prof:
        plain(torch.randn(3, 8)).sum().backward()
    results["plain"] = collectives_of(prof, world)["counts"]
    return results


@pytest.mark.parametrize("world", [2, 3])
def test_gloo_comms_match_torchs_and_send_the_analytic_volume(world):
    """At 3 ranks FSDP2 pads every dim 0 (8 and 2 rows) to a multiple of 3: the padded gradient is what is sent."""
    for rank, results in enumerate(run_distributed(_compare, world)):
        counted, plain = results.pop("counted"), results.pop("plain")
        gathers = [key for key in results if key[0] == "gather"]
        assert len(gathers) == (4 if world > 2 and rank >= 1 else 3), gathers
        for _, dtype in gathers:
            expected, gathered = results.pop(("gather", dtype))
            for got in gathered:  # copies: exactly equal
                torch.testing.assert_close(got, expected, rtol=0, atol=0, msg=f"rank {rank} gather {dtype}")
        for key, (expected, got) in results.items():
            # The same sums in another order: fp32 rounding, bf16's coarser one.
            tolerance = 1e-6 if "float32" in key[0] else 1e-2
            torch.testing.assert_close(got, expected, rtol=tolerance, atol=tolerance, msg=f"rank {rank} {key}")
        # Two units (the block, the root) each gather their parameters once (one broadcast per rank) and all-to-all
        # their gradients once: (w-1)/w of 4 bytes per element each way.
        padded = lambda rows, cols: -(-rows // world) * world * cols
        numel = padded(8, 8) + padded(8, 1) + padded(2, 8) + padded(2, 1)
        assert counted["counts"] == {"A2A": 2, "BC": 2 * world}, counted
        assert counted["bytes"] == 2 * (world - 1) / world * 4 * numel, counted
        assert plain == {"RS": 1, "AG": 1}, plain
