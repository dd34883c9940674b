"""``_compat.dtensor.equal_over_mesh``: ``torch.equal`` of DTensors agreed over their mesh, on ranks that compare
different tensors, or different numbers of them (pipeline stages), as torch's own all-reduce over the world cannot."""

from __future__ import annotations

import datetime
import time
from typing import Any

import pytest
import torch
import torch.distributed as dist

from lightning_mgpu._compat import dtensor
from tests.helpers.distributed import run_distributed


def _stages_compare(torch_own: bool) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=3))
    rank = dist.get_rank()
    stage_mesh = init_device_mesh("cpu", (2, 1), mesh_dim_names=("pp", "dp"))["dp"]  # this rank alone: its stage
    a = distribute_tensor(torch.arange(4.0) + rank, stage_mesh, [Replicate()])
    if torch_own:  # only stage 0 compares: torch's answer waits for stage 1 in a world-wide all-reduce
        if rank == 1:
            time.sleep(5)
            return {}
        try:
            torch.equal(a, a)
        except RuntimeError as error:
            return {"timed_out": "Timed out" in str(error) or "timeout" in str(error).lower()}
        return {"timed_out": False}
    undo = dtensor.equal_over_mesh()
    try:
        out = {"same": torch.equal(a, a)}
        if rank == 0:  # stage 0 compares more tensors than stage 1
            b = distribute_tensor(torch.arange(4.0), stage_mesh, [Replicate()])
            out["other values"] = torch.equal(a, b * 2)
            out["other shape"] = torch.equal(a, distribute_tensor(torch.zeros(5), stage_mesh, [Replicate()]))
            out["other placement"] = torch.equal(a, distribute_tensor(torch.arange(4.0), stage_mesh, [Shard(0)]))
            try:
                torch.equal(a, torch.arange(4.0))
            except RuntimeError as error:
                out["mixed"] = "mixed torch.Tensor and DTensor" in str(error)
        dist.barrier()
    finally:
        undo()
    handlers = torch.distributed.tensor.DTensor._op_dispatcher._custom_op_handlers
    out["undone"] = torch.ops.aten.equal.default not in handlers
    return out


def test_equal_agrees_over_the_mesh_when_stages_compare_different_tensors() -> None:
    results = run_distributed(_stages_compare, 2, False, timeout=60)
    assert results[0] == {
        "same": True,
        "other values": False,
        "other shape": False,
        "other placement": True,
        "mixed": True,
        "undone": True,
    }
    assert results[1] == {"same": True, "undone": True}


@pytest.mark.slow
def test_torch_still_reduces_equal_over_the_world() -> None:
    """Why the shim exists: when this fails, torch reduces over the mesh and ``equal_over_mesh`` can go."""
    results = run_distributed(_stages_compare, 2, True, timeout=60)
    assert results[0] == {"timed_out": True}
