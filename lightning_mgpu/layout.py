"""The parallel layout: how many ways the job is split along each axis, and the device mesh that realises it.

Every other module asks the layout for its process groups; nobody computes ranks by hand.
The mesh is ``(pp, dp, tp)`` with ``tp`` innermost, so consecutive ranks (the GPUs of one node) form a
tensor-parallel group and the chattiest collectives stay on the fastest links. Under hybrid sharding (HSDP) ``dp``
is itself ``(dp_replicate, dp_shard)``, shard groups of consecutive ranks inside replicas.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, NamedTuple

import torch

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

PP_AXIS = "pp"
DP_AXIS = "dp"
TP_AXIS = "tp"
MESH_AXES = (PP_AXIS, DP_AXIS, TP_AXIS)
# Context parallelism splits each sequence over ``cp`` ranks between dp and tp: ``(pp, dp, cp, tp)``. Its ranks hold
# replicated weights and see the same samples, so gradients average over ``dp x cp`` flattened (``dp_cp``).
CP_AXIS = "cp"
DP_CP_AXIS = "dp_cp"
# Expert parallelism cuts the data-parallel axis in two, ``dp = replicas x ep``: ranks of one ``ep`` group hold
# different experts, ranks of one replica group the same ones (``parallel.experts``).
EP_AXIS = "ep"
EXPERT_REPLICA_AXIS = "ep_replicate"
# Hybrid sharding (HSDP) cuts the data-parallel axis the same way, ``dp = replicas x shard``: ZeRO shards over the
# ranks of one ``dp_shard`` group (consecutive ranks: a node) and replicates across ``dp_replicate`` (parallel.data).
DP_REPLICATE_AXIS = "dp_replicate"
DP_SHARD_AXIS = "dp_shard"
HYBRID_SHARD_AXES = (DP_REPLICATE_AXIS, DP_SHARD_AXIS)

ZERO_STAGES = (0, 1, 2, 3)

Size = int | Literal["auto"]
"""A parallel size as ``HybridStrategy`` takes it: a positive ``int``, or ``"auto"``. ``"auto"`` on
``data_parallel_size`` takes what the other sizes leave of ``devices x num_nodes``; on ``tensor_parallel_size``,
``pipeline_parallel_size`` (and ``zero_stage``) it lets the planner choose at setup for the real module among the
layouts the other arguments allow (1 where it cannot read the module)."""


def _check_size(name: str, value: object, allow_auto: bool) -> None:
    if allow_auto and value == "auto":
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        valid = "a positive integer" + (" or 'auto'" if allow_auto else "")
        raise ValueError(f"`{name}` must be {valid}, got {value!r}.")


def _check_shard_size(value: object) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise ValueError(
            "`data_parallel_shard_size` must be a positive integer (ZeRO shards over groups of that many"
            f" data-parallel ranks) or None (over all of them), got {value!r}."
        )


@dataclass(frozen=True)
class ParallelLayout:
    """Every degree of the job, resolved: data, tensor, pipeline, context and expert parallelism, the ZeRO stage
    and HSDP's shard groups; what ``trainer.strategy.layout`` holds once the Trainer is built;
    ``dp * tp * pp * cp == world_size`` (``ep`` and ``dp_shard`` cut the data-parallel ranks, they add none).

    The mesh is ``(pp, dp, tp)`` (``(pp, dp, cp, tp)`` with context parallelism), tensor parallelism innermost:
    rank ``r`` sits at ``coordinates(r)``; ``describe()`` says the sizes in one line, as the strategy's messages do.

    Attributes:
        data_parallel_size: Replicas that see different samples and average their gradients (ZeRO shards over
            them).
        tensor_parallel_size: Ranks each layer's weights are split over (consecutive ranks: one node's links).
        pipeline_parallel_size: Pipeline stages the blocks are cut into.
        zero_stage: 0 (replicated), 1 (+ sharded optimizer states), 2 (+ gradients) or 3 (+ parameters).
        context_parallel_size: Ranks each sequence is split over.
        expert_parallel_size: Data-parallel ranks each mixture-of-experts layer's experts are split over
            (``dp = replicas x ep``, ``parallel.experts``).
        data_parallel_shard_size: HSDP: ZeRO shards over groups of this many consecutive data-parallel ranks and
            replicates across ``dp / shard`` of them (``parallel.data``); ``None``: over all of them.

    Example:
        ```python
        from lightning_mgpu import ParallelLayout

        layout = ParallelLayout.resolve(8, tensor_parallel_size=2, pipeline_parallel_size=2, zero_stage=1)
        assert layout.describe() == "dp=2 x tp=2 x pp=2 (zero_stage=1)"
        assert layout.coordinates(5) == {"pp": 1, "dp": 0, "tp": 1}
        ```
    """

    data_parallel_size: int = 1
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    zero_stage: int = 0
    context_parallel_size: int = 1
    expert_parallel_size: int = 1
    data_parallel_shard_size: int | None = None

    def __post_init__(self) -> None:
        _check_size("data_parallel_size", self.data_parallel_size, allow_auto=False)
        _check_size("context_parallel_size", self.context_parallel_size, allow_auto=False)
        _check_size("tensor_parallel_size", self.tensor_parallel_size, allow_auto=False)
        _check_size("pipeline_parallel_size", self.pipeline_parallel_size, allow_auto=False)
        _check_zero_stage(self.zero_stage)
        # How ep and the shard size fit dp is each parallelism's check (``layout_checks``), in its own words.
        _check_size("expert_parallel_size", self.expert_parallel_size, allow_auto=False)
        _check_shard_size(self.data_parallel_shard_size)

    @classmethod
    def resolve(
        cls,
        world_size: int,
        data_parallel_size: Size = "auto",
        tensor_parallel_size: Size = 1,
        pipeline_parallel_size: Size = 1,
        zero_stage: int | Literal["auto"] = 0,
        context_parallel_size: int = 1,
        expert_parallel_size: int = 1,
        data_parallel_shard_size: int | None = None,
    ) -> ParallelLayout:
        """Fill in ``"auto"`` sizes from the world size and check that the product covers every process.

        ``"auto"`` on data parallel takes whatever tensor and pipeline parallel leave; ``"auto"`` on tensor or
        pipeline parallel means 1 (no split) unless every other size is fixed, in which case it takes the rest;
        ``zero_stage="auto"`` means 0. This is the rule without a model: where several layouts are possible,
        ``HybridStrategy`` asks the planner at setup instead (``planner.auto``). ``expert_parallel_size`` and
        ``data_parallel_shard_size`` are kept as given.
        """
        _check_size("world_size", world_size, allow_auto=False)
        _check_size("context_parallel_size", context_parallel_size, allow_auto=False)
        cp = context_parallel_size
        if world_size % cp:
            raise ValueError(
                f"context_parallel_size={cp} does not divide the world size {world_size} (devices x num_nodes)."
                f" Choose one of {divisors(world_size)}."
            )
        world_size //= cp  # the other sizes share what context parallelism leaves
        sizes = {
            "data_parallel_size": data_parallel_size,
            "tensor_parallel_size": tensor_parallel_size,
            "pipeline_parallel_size": pipeline_parallel_size,
        }
        for name, value in sizes.items():
            _check_size(name, value, allow_auto=True)
        _check_zero_stage(zero_stage, allow_auto=True)
        zero_stage = 0 if zero_stage == "auto" else zero_stage
        auto = [name for name, value in sizes.items() if value == "auto"]
        # dp absorbs the remainder first; tp/pp only when dp is fixed.
        absorber = "data_parallel_size" if "data_parallel_size" in auto else (auto[0] if auto else None)
        for name in auto:
            if name != absorber:
                sizes[name] = 1
        fixed = 1
        for name, value in sizes.items():
            if name != absorber:
                fixed *= value  # type: ignore[assignment]
        if absorber is not None:
            if world_size % fixed:
                named = " x ".join(f"{name}={value}" for name, value in sizes.items() if name != absorber)
                raise ValueError(
                    f"The fixed parallel sizes multiply to {fixed}, which does not divide the world size {world_size}"
                    f" (devices x num_nodes): {named}. Choose sizes whose product divides {world_size}:"
                    f" {divisors(world_size)}."
                )
            sizes[absorber] = world_size // fixed
        layout = cls(
            zero_stage=zero_stage,
            context_parallel_size=cp,
            expert_parallel_size=expert_parallel_size,
            data_parallel_shard_size=data_parallel_shard_size,
            **sizes,  # type: ignore[arg-type]
        )
        if layout.world_size != world_size * cp:
            with_cp = f" x context_parallel_size={cp}" if cp > 1 else ""
            raise ValueError(
                f"data_parallel_size={layout.data_parallel_size} x tensor_parallel_size={layout.tensor_parallel_size}"
                f" x pipeline_parallel_size={layout.pipeline_parallel_size}{with_cp} = {layout.world_size} processes,"
                f" but the Trainer has {world_size * cp} (devices x num_nodes)."
                f" Make the product equal {world_size * cp}, or set `data_parallel_size='auto'`."
            )
        return layout

    @property
    def world_size(self) -> int:
        return self.data_parallel_size * self.tensor_parallel_size * self.pipeline_parallel_size * self.cp

    # The sizes by their mesh axes' names, as the planner and the docs write layouts (``tp=8 pp=4``).
    @property
    def dp(self) -> int:
        return self.data_parallel_size

    @property
    def tp(self) -> int:
        return self.tensor_parallel_size

    @property
    def pp(self) -> int:
        return self.pipeline_parallel_size

    @property
    def cp(self) -> int:
        return self.context_parallel_size

    @property
    def ep(self) -> int:
        return self.expert_parallel_size

    @property
    def dp_shard(self) -> int | None:
        return self.data_parallel_shard_size

    @property
    def gradient_ranks(self) -> int:
        """Ranks that hold the same weights and average their gradients: ``dp x cp``."""
        return self.data_parallel_size * self.cp

    @property
    def mesh_axes(self) -> tuple[str, ...]:
        return MESH_AXES if self.cp == 1 else (PP_AXIS, DP_AXIS, CP_AXIS, TP_AXIS)

    @property
    def mesh_shape(self) -> tuple[int, ...]:
        """The mesh's sizes along ``mesh_axes``: ``(pp, dp, tp)``, or ``(pp, dp, cp, tp)`` with context parallelism."""
        pp, dp, tp = self.pipeline_parallel_size, self.data_parallel_size, self.tensor_parallel_size
        return (pp, dp, tp) if self.cp == 1 else (pp, dp, self.cp, tp)

    def coordinates(self, rank: int) -> dict[str, int]:
        """Where global ``rank`` sits in the mesh: ``{"pp": ..., "dp": ..., "tp": ...}`` (with ``"cp"``), the mesh
        row-major over ``mesh_axes`` (tp innermost: consecutive ranks share a tensor-parallel group)."""
        place: dict[str, int] = {}
        rest = rank
        for name, size in reversed(list(zip(self.mesh_axes, self.mesh_shape))):
            place[name] = rest % size
            rest //= size
        return dict(reversed(list(place.items())))

    def describe(self) -> str:
        """The sizes in one line, as the strategy's messages and logs say them:
        ``dp=2 x tp=2 x pp=2 (zero_stage=1)`` (the mesh drawn rank by rank: Choosing a layout); expert parallelism
        and HSDP's shard groups, which cut dp, beside the ZeRO stage when set: ``(zero_stage=1, ep=2)``."""
        cp = f" x cp={self.cp}" if self.cp > 1 else ""
        within = [f"zero_stage={self.zero_stage}"]
        if self.ep > 1:
            within.append(f"ep={self.ep}")
        if self.dp_shard is not None:
            within.append(f"dp_shard={self.dp_shard}")
        return (
            f"dp={self.data_parallel_size} x tp={self.tensor_parallel_size} x pp={self.pipeline_parallel_size}{cp}"
            f" ({', '.join(within)})"
        )

    def build_mesh(self, device_type: str) -> DeviceMesh:
        """Create the named ``(pp, dp, tp)`` mesh; needs an initialized default process group.

        With ``data_parallel_shard_size`` (HSDP) the mesh is ``(pp, dp_replicate, dp_shard, tp)``, ``dp_shard`` of
        that size, and ``dp`` is both of them flattened: ``mesh["dp"]`` stays the whole data-parallel group.
        """
        from torch.distributed.device_mesh import init_device_mesh

        from lightning_mgpu._compat.dtensor import flatten_mesh

        world = torch.distributed.get_world_size()
        if world != self.world_size:
            raise RuntimeError(f"The layout {self.describe()} needs {self.world_size} processes, found {world}.")
        shard = self.data_parallel_shard_size
        if self.cp > 1:  # gradients average over dp x cp: one flattened group for the data-parallel wrap
            mesh = init_device_mesh(device_type, self.mesh_shape, mesh_dim_names=self.mesh_axes)
            flatten_mesh(mesh, (DP_AXIS, CP_AXIS), DP_CP_AXIS)
            return mesh
        if shard is None or shard == self.data_parallel_size:
            return init_device_mesh(device_type, self.mesh_shape, mesh_dim_names=MESH_AXES)
        if self.data_parallel_size % shard:
            raise ValueError(f"data_parallel_shard_size={shard} does not divide {self.describe()}'s data parallelism.")
        pp, dp, tp = self.pipeline_parallel_size, self.data_parallel_size, self.tensor_parallel_size
        shape = (pp, dp // shard, shard, tp)
        mesh = init_device_mesh(device_type, shape, mesh_dim_names=(PP_AXIS, *HYBRID_SHARD_AXES, TP_AXIS))
        flatten_mesh(mesh, HYBRID_SHARD_AXES, DP_AXIS)
        return mesh


class RequestedSizes(NamedTuple):
    """The degrees as ``HybridStrategy`` takes them, before the world size is known (``"auto"`` where
    :data:`Size` allows it); :meth:`resolve` on the Trainer's world size gives the run's :class:`ParallelLayout`
    (or the planner chooses among ``planner.auto.layout_candidates(world_size, *requested)``)."""

    data_parallel_size: Size = "auto"
    tensor_parallel_size: Size = 1
    pipeline_parallel_size: Size = 1
    zero_stage: int | Literal["auto"] = 0
    context_parallel_size: int = 1
    expert_parallel_size: int = 1
    data_parallel_shard_size: int | None = None

    def resolve(self, world_size: int) -> ParallelLayout:
        return ParallelLayout.resolve(
            world_size,
            self.data_parallel_size,
            self.tensor_parallel_size,
            self.pipeline_parallel_size,
            self.zero_stage,
            self.context_parallel_size,
            self.expert_parallel_size,
            self.data_parallel_shard_size,
        )

    @property
    def smallest_world_size(self) -> int:
        """The world size these sizes need with every ``"auto"`` one 1, to validate them before it is known."""
        sizes = (self.data_parallel_size, self.tensor_parallel_size, self.pipeline_parallel_size)
        return minimum_world_size(*sizes, self.context_parallel_size)


# What Lightning's ModelParallelStrategy calls its mesh's dimensions: a `configure_model` written for it reads
# `self.device_mesh["data_parallel"]` (here the ranks whose gradients average: dp, or dp x cp) and
# `self.device_mesh["tensor_parallel"]`.
LIGHTNING_AXES = ("data_parallel", "tensor_parallel")


class ModuleMesh:
    """The run's mesh as ``self.device_mesh`` shows it to the LightningModule: the mesh itself, whose dimensions
    also answer to Lightning's ModelParallelStrategy names, so that a module written for that strategy runs
    unchanged. Everything else is the mesh's own."""

    def __init__(self, mesh: DeviceMesh) -> None:
        self.mesh = mesh

    def __getitem__(self, names: str | tuple[str, ...]) -> DeviceMesh:
        ours = tuple(self._ours(name) for name in ((names,) if isinstance(names, str) else names))
        return self.mesh[ours[0] if len(ours) == 1 else ours]

    def _ours(self, name: str) -> str:
        if name == "tensor_parallel":
            return TP_AXIS
        if name == "data_parallel":
            return DP_CP_AXIS if CP_AXIS in (self.mesh.mesh_dim_names or ()) else DP_AXIS
        return name

    def __getattr__(self, name: str) -> object:
        if name == "mesh":  # not set yet: a copy (deepcopy, pickle) builds the object without __init__
            raise AttributeError(name)
        return getattr(self.mesh, name)

    def __repr__(self) -> str:
        return f"{self.mesh!r} (also 'data_parallel', 'tensor_parallel', as Lightning's ModelParallelStrategy names)"


def gradient_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """The ranks whose gradients average (the data-parallel wrap's group): ``dp``, or ``dp x cp`` flattened."""
    return mesh[DP_CP_AXIS] if CP_AXIS in (mesh.mesh_dim_names or ()) else mesh[DP_AXIS]


def zero_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """The mesh ZeRO wraps over: the gradient mesh, or ``(dp_replicate, dp_shard)`` under hybrid sharding."""
    return mesh[HYBRID_SHARD_AXES] if DP_SHARD_AXIS in (mesh.mesh_dim_names or ()) else gradient_mesh(mesh)


def zero_shard_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """The ranks that split ZeRO's states among themselves: ``dp_shard`` under hybrid sharding, else the gradient
    mesh."""
    return mesh[DP_SHARD_AXIS] if DP_SHARD_AXIS in (mesh.mesh_dim_names or ()) else gradient_mesh(mesh)


def warn_about_layout(layout: ParallelLayout, devices_per_node: int, num_nodes: int, wrapped: bool) -> None:
    """Valid layouts that waste something, said once (not refused: one config runs on machines of any size).

    ``wrapped``: the data-parallel wrap applies at dp=1 anyway (CPU offload, a parameter-dtype cast).
    """
    from lightning.pytorch.utilities.rank_zero import rank_zero_warn

    for warning in layout_warnings(layout, devices_per_node, num_nodes, wrapped):
        rank_zero_warn(warning)


def layout_warnings(layout: ParallelLayout, devices_per_node: int, num_nodes: int, wrapped: bool = False) -> list[str]:
    """What :func:`warn_about_layout` says about ``layout`` (the planner prints it beside a plan)."""
    found = []
    if layout.zero_stage and layout.data_parallel_size == 1 and not wrapped:
        found.append(
            f"zero_stage={layout.zero_stage} shards over data-parallel ranks, but data_parallel_size=1"
            f" ({layout.describe()}): nothing is sharded and training runs as with zero_stage=0. Give data"
            " parallelism more devices, or set zero_stage=0."
        )
    tp = layout.tensor_parallel_size
    if num_nodes > 1 and devices_per_node % tp:
        found.append(
            f"tensor_parallel_size={tp} does not divide the {devices_per_node} devices of a node, so some"
            " tensor-parallel groups span nodes and their per-layer collectives cross the network. Choose a"
            f" tensor_parallel_size that divides {devices_per_node} to keep them within a node."
        )
    return found


def _check_zero_stage(zero_stage: object, allow_auto: bool = False) -> None:
    if allow_auto and zero_stage == "auto":
        return
    if isinstance(zero_stage, bool) or zero_stage not in ZERO_STAGES:
        auto = " or 'auto' (the planner chooses)" if allow_auto else ""
        raise ValueError(
            f"`zero_stage` must be one of {ZERO_STAGES} (0: replicated, 1: + sharded optimizer states,"
            f" 2: + sharded gradients, 3: + sharded parameters){auto}, got {zero_stage!r}."
        )


def divisors(n: int) -> list[int]:
    """The positive divisors of ``n``, ascending (the sizes an axis of ``n`` ranks can take)."""
    return [d for d in range(1, n + 1) if n % d == 0]


def degree_splits(world_size: int, context_parallel_size: int = 1) -> Iterator[tuple[int, int, int]]:
    """Every ``(dp, tp, pp)`` with ``dp * tp * pp * cp == world_size``, tp ascending, then pp: the one enumeration
    that ``"auto"`` sizes, the planner's search and the measured sweep (``lightning-mgpu bench``) share."""
    rest = world_size // context_parallel_size
    for tp in divisors(rest):
        for pp in divisors(rest // tp):
            yield rest // (tp * pp), tp, pp


def minimum_world_size(*sizes: Size) -> int:
    """The world size a layout needs when every ``"auto"`` size is 1, for validation before the world is known."""
    world = 1
    for size in sizes:
        if isinstance(size, int) and not isinstance(size, bool) and size > 0:
            world *= size
    return world
