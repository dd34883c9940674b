"""Where a pipeline's stages lie: the schedules we run, how many stages each rank holds and which, and the cut of
the model's blocks into stages (balanced by parameter count, or named by the user).

Pure planning over the module tree and a few integers: nothing here touches the module or a process group, so the
options check it before any process starts and the runtime (``pipeline``) applies it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import nn

from lightning_mgpu.parallel.blocks import block_at, find_block_container, network_copies
from lightning_mgpu.parallel.pipeline.call_order import use_order

SINGLE_STAGE_SCHEDULES = ("GPipe", "1F1B")
LOOP_SCHEDULES = ("Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble")
V_SCHEDULES = ("ZBVZeroBubble", "DualPipeV")
PIPELINE_SCHEDULES = SINGLE_STAGE_SCHEDULES + LOOP_SCHEDULES + V_SCHEDULES  # every `pipeline_schedule` we run


def stages_per_rank(schedule: str, requested: int | None) -> int:
    """Virtual stages per rank: 1 for GPipe/1F1B, 2 for interleaved and V schedules unless given."""
    if schedule in SINGLE_STAGE_SCHEDULES:
        if requested not in (None, 1):
            raise ValueError(
                f"pipeline_schedule={schedule!r} runs one stage per rank; got stages_per_rank={requested}."
            )
        return 1
    if schedule in V_SCHEDULES and requested not in (None, 2):
        raise ValueError(f"pipeline_schedule={schedule!r} places two stages per rank (a V); got {requested}.")
    return requested or 2


def bubble_fraction(pp: int, microbatches: int, stages_per_rank: int = 1) -> float:
    """Idle share of a pipeline step in theory: (p-1)/(v*m+p-1) for ``v`` stages per rank (Narayanan et al.,
    2021). Zero-bubble schedules fill part of it with weight-gradient work; for them it bounds their placement."""
    if pp <= 1:
        return 0.0
    return (pp - 1) / (stages_per_rank * microbatches + pp - 1)


def stage_indices(schedule: str, pp_rank: int, pp_size: int, per_rank: int) -> list[int]:
    """Which global stages this rank runs: looped (r, r+p, ...) or V-shaped (r, 2p-1-r)."""
    if schedule in V_SCHEDULES:
        return [pp_rank, 2 * pp_size - 1 - pp_rank]
    return [pp_rank + k * pp_size for k in range(per_rank)]


def stage_owner(schedule: str, stage: int, pp_size: int, per_rank: int) -> int:
    """The pipeline rank that runs ``stage`` (the inverse of :func:`stage_indices`)."""
    return next(r for r in range(pp_size) if stage in stage_indices(schedule, r, pp_size, per_rank))


def balance(costs: list[int], num_stages: int, first_extra: int = 0, last_extra: int = 0) -> list[int]:
    """Start index of each stage: contiguous groups of blocks minimizing the largest stage's parameter count.

    ``first_extra``/``last_extra`` are the parameters that come with the first/last stage (embeddings, head).
    """
    n = len(costs)
    prefix = [0]
    for cost in costs:
        prefix.append(prefix[-1] + cost)
    inf = float("inf")
    # best[s][i]: minimal max-cost splitting the first i blocks into s stages; cut[s][i]: start of the last stage.
    best = [[inf] * (n + 1) for _ in range(num_stages + 1)]
    cut = [[0] * (n + 1) for _ in range(num_stages + 1)]
    best[0][0] = 0
    for s in range(1, num_stages + 1):
        for i in range(s, n - (num_stages - s) + 1):
            for j in range(s - 1, i):
                stage = prefix[i] - prefix[j] + (first_extra if j == 0 else 0) + (last_extra if i == n else 0)
                value = max(best[s - 1][j], stage)
                if value < best[s][i]:
                    best[s][i], cut[s][i] = value, j
    starts, i = [], n
    for s in range(num_stages, 0, -1):
        i = cut[s][i]
        starts.append(i)
    return starts[::-1]


@dataclass
class PipelineSplit:
    """Where the blocks are and which modules come before and after them in the network's call."""

    container_fqn: str
    num_blocks: int
    before: list[str]  # FQNs of modules with parameters that run before the blocks (first stage only)
    after: list[str]  # ... and after them (last stage only)
    starts: list[int] = field(default_factory=list)  # first block index of each stage
    # Parameters held directly by a module on the path to the blocks (a ViT's ``cls_token``), by FQN
    before_parameters: list[str] = field(default_factory=list)
    after_parameters: list[str] = field(default_factory=list)

    def blocks_of(self, stage: int) -> range:
        end = self.starts[stage + 1] if stage + 1 < len(self.starts) else self.num_blocks
        return range(self.starts[stage], end)

    def module_stages(self) -> dict[str, int]:
        """The stage of each module the split places, by FQN (the modules under one go with it)."""
        stages = {f"{self.container_fqn}.{i}": s for s in range(len(self.starts)) for i in self.blocks_of(s)}
        stages.update(dict.fromkeys(self.before, 0))
        stages.update(dict.fromkeys(self.after, len(self.starts) - 1))
        return stages


def check_stage_count(num_stages: int, num_blocks: int, where: str) -> None:
    """A stage needs a block at least (the planner checks a model's layer count with it, in the same words)."""
    if num_blocks < num_stages:
        raise ValueError(
            f"{num_stages} pipeline stages need at least {num_stages} blocks, but {where} has {num_blocks}."
            " Lower pipeline_parallel_size (or stages_per_rank)."
        )


def plan_split(module: nn.Module, num_stages: int, pipeline_split: str | list[str]) -> PipelineSplit:
    container_fqn, container = _stage_container(module, pipeline_split)
    _refuse_split_network_copies(module, container_fqn)
    check_stage_count(num_stages, len(container), repr(container_fqn))
    (before, before_parameters), (after, after_parameters) = _around(module, container_fqn)
    split = PipelineSplit(container_fqn, len(container), before, after, [], before_parameters, after_parameters)
    if pipeline_split == "auto":
        costs = [sum(p.numel() for p in block_at(container, i).parameters()) for i in range(len(container))]
        sizes = dict(module.named_parameters())
        size = lambda names, parameters: (
            sum(p.numel() for n in names for p in module.get_submodule(n).parameters())
            + (sum(sizes[n].numel() for n in parameters))
        )
        split.starts = balance(costs, num_stages, size(before, before_parameters), size(after, after_parameters))
    else:
        split.starts = _explicit_starts(list(pipeline_split), container_fqn, len(container), num_stages)
    return split


def _refuse_split_network_copies(module: nn.Module, container_fqn: str) -> None:
    """A network the stages split whose copy the module also holds (a target network, an EMA teacher) is refused:
    each stage would hold part of the network and the whole copy, and the user's weight copies between them
    (``load_state_dict``, an EMA update zipping both ``parameters()``) would miss or mispair the other stages'."""
    for first, second in network_copies(module):
        for split, copy in ((first, second), (second, first)):
            if container_fqn == split or container_fqn.startswith(f"{split}."):
                raise ValueError(
                    f"pipeline_parallel_size > 1 splits {split!r} (its blocks {container_fqn!r}) across stages, but the"
                    f" module also holds {copy!r}, a copy of it (the same modules and parameter shapes: a target"
                    f" network, an EMA teacher). Each stage would hold only its part of {split!r} and all of"
                    f" {copy!r}: `{copy}.load_state_dict({split}.state_dict())` would miss the other stages' weights."
                    " Use pipeline_parallel_size=1 for this module: tensor parallelism shards both alike, and"
                    " data parallelism (zero_stage up to 3) trains it as one process does."
                )


def _stage_container(
    module: nn.Module, pipeline_split: str | list[str]
) -> tuple[str, nn.ModuleList | nn.Sequential | nn.ModuleDict]:
    """The ModuleList/Sequential whose children are cut into stages.

    An explicit split names it (the parent of its entries); otherwise the model's repeated blocks, or failing
    those, its largest ``Sequential`` (a plain sequential network: every child is a block).
    """
    if pipeline_split != "auto":
        parents = {name.rpartition(".")[0] for name in pipeline_split}
        parent = parents.pop() if len(parents) == 1 else None
        container = _submodule_or_none(module, parent) if parent else None
        if parent and isinstance(container, (nn.ModuleList, nn.Sequential, nn.ModuleDict)):
            return parent, container
    found = find_block_container(module) or _largest_sequential(module)
    if found is None:
        raise ValueError(
            "pipeline_parallel_size > 1 needs the model's layers in a ModuleList/Sequential (the repeated blocks of"
            " GPT, Llama, ... or a Sequential network), and none was found. Give `pipeline_split` as the names of"
            " the children of one ModuleList/Sequential where stages begin, e.g. ['model.layers.4']."
        )
    return found


def _submodule_or_none(module: nn.Module, name: str) -> nn.Module | None:
    try:
        return module.get_submodule(name)
    except AttributeError:
        return None


def _largest_sequential(module: nn.Module) -> tuple[str, nn.Sequential] | None:
    candidates = [
        (sum(p.numel() for p in child.parameters()), name, child)
        for name, child in module.named_modules()
        if isinstance(child, nn.Sequential) and sum(1 for c in child if any(True for _ in c.parameters())) >= 2
    ]
    if not candidates:
        return None
    _, name, child = max(candidates, key=lambda candidate: candidate[0])
    return name, child


def _around(module: nn.Module, container_fqn: str) -> tuple[tuple[list[str], list[str]], tuple[list[str], list[str]]]:
    """What runs before and after the blocks: ``((modules, parameters), (modules, parameters))`` by FQN.

    The modules with parameters beside the path from ``module`` down to the blocks, and the parameters held directly
    by the modules on that path (a ViT's ``cls_token``), each placed by where the model's code first uses it
    relative to the blocks (``call_order``); by registration order where the code does not show it.
    """
    order = {name: index for index, name in enumerate(use_order(module))}
    blocks_at = order.get(container_fqn)
    before: tuple[list[str], list[str]] = ([], [])
    after: tuple[list[str], list[str]] = ([], [])
    node = module
    prefix = ""
    for part in container_fqn.split("."):
        seen = False
        for name, child in node.named_children():
            if name == part:
                seen = True
                continue
            if any(True for _ in child.parameters()):
                runs_after = _runs_after(order, f"{prefix}{name}", blocks_at, registered_after=seen)
                (after if runs_after else before)[0].append(f"{prefix}{name}")
        holds = [f"{prefix}{name}" for name, _ in node.named_parameters(recurse=False)]
        places = {fqn: _runs_after(order, fqn, blocks_at, registered_after=False) for fqn in holds}
        if len(set(places.values())) > 1:
            raise NotImplementedError(
                f"{type(node).__name__} at {prefix.rstrip('.') or 'the root'} holds parameters used before the"
                f" pipeline's blocks ({[f for f, a in places.items() if not a]}) and after them"
                f" ({[f for f, a in places.items() if a]}): a pipeline cut cannot give them to two stages yet. Use"
                " pipeline_parallel_size=1 for this model (tensor and data parallelism run it as is)."
            )
        for fqn, runs_after in places.items():
            (after if runs_after else before)[1].append(fqn)
        node, prefix = node.get_submodule(part), f"{prefix}{part}."
    return before, after


def _runs_after(order: dict[str, int], fqn: str, blocks_at: int | None, registered_after: bool) -> bool:
    """Whether the code first uses ``fqn`` (or anything under it) after the blocks; registration order if unknown."""
    uses = [index for name, index in order.items() if name == fqn or name.startswith(f"{fqn}.")]
    if blocks_at is None or not uses:
        return registered_after
    return min(uses) > blocks_at


def _explicit_starts(names: list[str], container_fqn: str, num_blocks: int, num_stages: int) -> list[int]:
    indices = []
    for name in names:
        head, _, index = name.rpartition(".")
        if head != container_fqn or not index.isdigit() or not 0 <= int(index) < num_blocks:
            raise ValueError(
                f"`pipeline_split` entry {name!r} is not one of the blocks {container_fqn}.0 ..."
                f" {container_fqn}.{num_blocks - 1}."
            )
        indices.append(int(index))
    if indices and indices[0] != 0:
        indices = [0, *indices]
    if len(indices) != num_stages or indices != sorted(set(indices)):
        raise ValueError(
            f"`pipeline_split` must name {num_stages - 1} increasing blocks where stages 1..{num_stages - 1} begin"
            f" (e.g. [{container_fqn!r}.{num_blocks // 2}] for 2 stages), got {names}."
        )
    return indices
