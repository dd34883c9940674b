"""Flat fragments: each rank writes only its flat range of a tensor (cut anywhere, as DeepSpeed's ZeRO cuts); the
checkpoint reads back whole, in one process, as if one rank had saved the tensor, and into ranges cut elsewhere."""

from __future__ import annotations

import math
import random
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from lightning_mgpu.checkpoint.flat_fragments import FlatFragment, FragmentLoadPlanner, FragmentSavePlanner, boxes
from tests.helpers.distributed import run_distributed

# Shapes and the flat offset where rank 1's range begins: inside a row, on a row boundary, inside an inner block,
# a scalar owned by one rank, a tensor owned by one rank.
CUTS = {"a": ((3, 4, 5), 17), "b": ((6, 4), 8), "c": ((2, 3, 4, 5), 61), "d": ((), 1), "e": ((7,), 0)}


def _whole(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def _save(path: str) -> list[int]:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    state = {}
    for i, (key, (shape, cut)) in enumerate(CUTS.items()):
        flat = _whole(shape, i).reshape(-1)
        start, stop = (0, cut) if rank == 0 else (cut, flat.numel())
        state[key] = FlatFragment(shape, flat[start:stop].clone(), start)
    dcp.save({"model": state}, checkpoint_id=path, planner=FragmentSavePlanner())
    return sorted(p.stat().st_size for p in Path(path).glob(f"__{rank}_*.distcp"))


def _load(path: str) -> None:
    """Each rank reads its range (cut elsewhere than the save cut) straight into its own buffer."""
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    state, expected = {}, {}
    for i, (key, (shape, cut)) in enumerate(CUTS.items()):
        flat = _whole(shape, i).reshape(-1)
        cut = (cut + 3) % (flat.numel() + 1)
        start, stop = (0, cut) if rank == 0 else (cut, flat.numel())
        state[key] = FlatFragment(shape, torch.zeros(stop - start), start)
        expected[key] = flat[start:stop]
    dcp.load({"model": state}, checkpoint_id=path, planner=FragmentLoadPlanner())
    for key, fragment in state.items():
        assert torch.equal(fragment.data, expected[key]), key


def test_boxes_cover_any_flat_range_in_order():
    rng = random.Random(0)
    for _ in range(500):
        shape = tuple(rng.randint(1, 5) for _ in range(rng.randint(0, 4)))
        numel = math.prod(shape)
        start = rng.randint(0, numel)
        stop = rng.randint(start, numel)
        found = boxes(shape, start, stop)
        assert len(found) <= max(1, 2 * len(shape) - 1)
        index = torch.arange(numel).reshape(shape)
        covered = [i for o, s in found for i in index[tuple(slice(a, a + b) for a, b in zip(o, s))].reshape(-1)]
        assert covered == list(range(start, stop)), (shape, start, stop, found)


def test_each_rank_writes_its_range_and_it_reads_back_whole(tmp_path):
    path = str(tmp_path / "ckpt")
    sizes = run_distributed(_save, 2, path)
    assert all(sizes), sizes  # both ranks wrote their own pieces
    metadata = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    assert len(metadata["model.a"].chunks) == 4  # rank 0: 3 boxes (rows, partial row); rank 1: partial row, rows
    loaded = {f"model.{key}": torch.empty(shape) for key, (shape, _) in CUTS.items()}
    dcp.load(loaded, checkpoint_id=path, no_dist=True)
    for i, (key, (shape, _)) in enumerate(CUTS.items()):
        assert torch.equal(loaded[f"model.{key}"], _whole(shape, i)), key
    run_distributed(_load, 2, path)


def test_a_deep_copy_holds_the_range_only():
    buffer = torch.arange(100.0)
    fragment = FlatFragment((4, 5), buffer[30:40], 3)
    import copy

    copied = copy.deepcopy(fragment)
    assert copied.data.untyped_storage().nbytes() == 10 * 4
    assert torch.equal(copied.data, fragment.data)
