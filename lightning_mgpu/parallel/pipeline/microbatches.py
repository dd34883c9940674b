"""How a pipeline step cuts its batch into microbatches: equal ones, as many as the schedule can run.

torch's schedules need microbatches of one shape and have rules of their own for their number (1F1B and DualPipeV
need at least as many as stages; interleaved ones a multiple of their rounds). A batch the requested count does
not divide (the ragged last batch of an epoch) is cut into another count of equal microbatches, which keeps the
mean of the microbatch losses, and the gradients, equal to the whole batch's.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from lightning_mgpu._compat.tensors import tree_flatten, tree_leaves
from lightning_mgpu.parallel.pipeline.plan import SINGLE_STAGE_SCHEDULES, V_SCHEDULES

# Schedules that run any number of microbatches, one per stage placement: a batch that the chosen schedule cannot
# cut (a last batch of one sample under 1F1B) runs on the same placement with one of these; gradients are the same.
_ANY_COUNT_SCHEDULE = {"single": "GPipe", "looped": "LoopedBFS", "v": "ZBVZeroBubble"}


def _placement(schedule: str) -> str:
    return "single" if schedule in SINGLE_STAGE_SCHEDULES else "v" if schedule in V_SCHEDULES else "looped"


def microbatch_count_error(schedule: str, count: int, pp_size: int, num_stages: int) -> str | None:
    """Why torch 2.13's ``schedule`` refuses ``count`` microbatches (``None`` when it runs them)."""
    if schedule in ("1F1B", "DualPipeV") and count < num_stages:
        return f"{schedule} needs at least as many microbatches as stages ({num_stages}), got {count}"
    if schedule in ("Interleaved1F1B", "InterleavedZeroBubble"):
        rounds = max(1, count // pp_size)
        if count % rounds:
            return f"{schedule} needs a multiple of {rounds} microbatches (its rounds of {pp_size}), got {count}"
    return None


@dataclass(frozen=True)
class MicrobatchPlan:
    count: int
    schedule: str


@functools.lru_cache(maxsize=64)  # asked every step, with the same few batch sizes
def plan_microbatches(schedule: str, requested: int, batch_size: int, pp_size: int, num_stages: int) -> MicrobatchPlan:
    """How to cut a batch of ``batch_size`` samples: into ``requested`` equal microbatches when it divides.

    Otherwise (a ragged last batch, a batch size that ``requested`` does not divide) into the largest number of
    equal microbatches below ``requested`` that the schedule runs, then above it; failing both, with the schedule's
    any-count peer of the same stage placement. Equal microbatches keep the step's loss (the mean of microbatch
    means) and gradients equal to the whole batch's, as one process computes them.
    """
    divisors = [d for d in range(1, batch_size + 1) if batch_size % d == 0]
    valid = [d for d in divisors if microbatch_count_error(schedule, d, pp_size, num_stages) is None]
    if requested in valid:
        return MicrobatchPlan(requested, schedule)
    below = [d for d in valid if d < requested]
    if below:
        return MicrobatchPlan(below[-1], schedule)
    above = [d for d in valid if d > requested]
    if above:
        return MicrobatchPlan(above[0], schedule)
    return MicrobatchPlan(max(d for d in divisors if d <= requested), _ANY_COUNT_SCHEDULE[_placement(schedule)])


def batch_size_of(batch: object) -> int:
    """The number of samples in ``batch``: the shared dim 0 of its tensors."""
    return _batch_size(tree_leaves(batch))


def _batch_size(leaves: list[object]) -> int:
    sizes = {t.shape[0] for t in leaves if torch.is_tensor(t) and t.dim() > 0}
    if len(sizes) != 1:
        raise ValueError(
            "Pipeline microbatching cuts every tensor of a batch along dim 0, so they must share it; found sizes"
            f" {sorted(sizes) or 'none (no tensor with a batch dimension)'}."
        )
    return sizes.pop()


def split_microbatches(batch: object, count: int) -> list[object]:
    """Cut every tensor of ``batch`` into ``count`` equal chunks along dim 0; other leaves are shared."""
    leaves, spec = tree_flatten(batch)
    size = _batch_size(leaves)
    if size % count:
        valid = [m for m in range(1, size + 1) if size % m == 0]
        raise ValueError(
            f"The per-data-parallel-rank batch of {size} samples does not split into num_microbatches={count}"
            f" equal microbatches. Use a num_microbatches in {valid}, or a batch size divisible by {count}."
        )
    chunks = [t.chunk(count) if torch.is_tensor(t) and t.dim() else None for t in leaves]  # each tensor cut once
    return [
        spec.unflatten([leaf if parts is None else parts[k] for leaf, parts in zip(leaves, chunks)])
        for k in range(count)
    ]


def tensor_leaves(tree: object) -> list[torch.Tensor]:
    return [t for t in tree_leaves(tree) if torch.is_tensor(t)]
