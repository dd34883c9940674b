"""Rehearse a large job on this machine: the real parallelizing code at the cluster's world size, on meta tensors.

For each distinct position in the mesh (every ``(pp, tp)`` coordinate of data-parallel replica 0, plus one rank of
every other kind of replica: each context-parallel and expert-parallel position), one rank of the job is played in a
worker process: torch's fake process group (``backend="fake"``: collectives return at once, world size and rank as on
the cluster), the user's LightningModule built on the meta device (no memory), then the library's own setup path,
``parallel.parallelize`` and ``ParallelRun.wire_optimizers`` (tensor plan, pipeline cut, tied weights, expert split,
ZeRO wrap, optimizer sharding), and one optimizer step on zero gradients so that the optimizer creates its states.
What the real job would refuse is refused here, with the same message.

Per rank: the bytes of its parameters, gradients (a parameter's local shard: FSDP2's sharded gradients, DDP's whole
ones) and optimizer states, and the blocks its pipeline stage holds.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import nn

from lightning_mgpu.checkpoint.format import CheckpointError
from lightning_mgpu.checkpoint.pretrained import (
    WeightMap,
    WeightsSource,
    map_weights,
    open_weights,
    planned_read_bytes,
)
from lightning_mgpu.layout import ParallelLayout
from lightning_mgpu.options import ParallelOptions
from lightning_mgpu.planner.cluster import ClusterSpec
from lightning_mgpu.planner.cost import STATE_KINDS, state_bytes
from lightning_mgpu.planner.job import Layout, Training, microbatching_for
from lightning_mgpu.planner.model_spec import ModelSpec, build_on_meta, load_class
from lightning_mgpu.rehearsal.step import (
    Collectives,
    StepBatch,
    configured,
    count_step_collectives,
    describe_collectives,
    optimizers_of,
)


@dataclass
class Pretrained:
    """The weights a rehearsed job starts from (``HybridStrategy(pretrained=..., pretrained_strict=...)``)."""

    source: WeightsSource
    strict: bool = True

    def map(self, module: nn.Module) -> WeightMap:
        return map_weights(module, self.source, self.strict)


class RehearsalError(RuntimeError):
    """A rank of the rehearsed job failed: the library refused the layout, or the module could not be built."""


@dataclass
class RankReport:
    """One rehearsed rank: where it sits in the mesh and what it holds."""

    rank: int
    coordinate: dict[str, int]
    parameter_bytes: int
    gradient_bytes: int
    optimizer_bytes: int
    layers: list[str] = field(default_factory=list)
    seconds: float = 0.0
    # One training step's collectives by axis and kind ({"tp": {"all_reduce": {"calls": 18, "bytes": ...}}}); None
    # with the reason in ``collectives_note`` where not counted (see ``rehearsal.step``).
    collectives: Collectives | None = None
    collectives_note: str = ""
    # With pretrained weights: the bytes this rank reads from the checkpoint (DCP's read plan, headers only).
    read_bytes: int | None = None

    def as_dict(self) -> dict[str, Any]:
        entry = asdict(self)
        entry.update(entry.pop("coordinate"))
        return entry


def positions(layout: ParallelLayout) -> list[int]:
    """The global ranks worth rehearsing: every ``(pp, tp)`` coordinate of data-parallel replica 0 (cp 0), then one
    rank (pp 0, tp 0) of each other context-parallel position and of each other expert-parallel position."""
    pp, dp, cp, tp = (
        layout.pipeline_parallel_size, layout.data_parallel_size, layout.context_parallel_size,
        layout.tensor_parallel_size,
    )  # fmt: skip

    def rank(p: int, d: int, c: int, t: int) -> int:
        return ((p * dp + d) * cp + c) * tp + t

    ranks = [rank(p, 0, 0, t) for p in range(pp) for t in range(tp)]
    ranks += [rank(0, 0, c, 0) for c in range(1, cp)]
    ranks += [rank(0, d, 0, 0) for d in range(1, min(layout.expert_parallel_size, dp))]
    return ranks


def coordinate(layout: ParallelLayout, rank: int) -> dict[str, int]:
    """``{"pp": ..., "dp": ..., "tp": ...}`` (and ``"cp"``) of a global rank in the ``(pp, dp, [cp,] tp)`` mesh."""
    return layout.coordinates(rank)


def rehearse(
    build: Callable[[], nn.Module],
    layout: ParallelLayout,
    options: ParallelOptions,
    ranks: list[int] | None = None,
    workers: int | None = None,
    timeout: float = 1800.0,
    step_batch: StepBatch | None = None,
    pretrained: Pretrained | None = None,
) -> list[RankReport]:
    """Play ``ranks`` (default: :func:`positions`) of a job of ``layout.world_size`` processes in ``workers`` forked
    processes (default: the CPU cores, at most 4). ``build`` makes the LightningModule (called on the meta device in
    each worker, once per rank). ``step_batch``: also count the collectives of one training step on such a batch of
    token ids (``rehearsal.step``). ``pretrained``: check the checkpoint's names and shapes against the module and
    each rank's slices against its layout, from headers only. Raises :class:`RehearsalError` with the first failing
    rank's error."""
    ranks = positions(layout) if ranks is None else ranks
    workers = max(1, min(workers or min(os.cpu_count() or 1, 4), len(ranks)))
    shares = [ranks[i::workers] for i in range(workers)]
    context: Any = mp.get_context("fork" if "fork" in mp.get_all_start_methods() else "spawn")
    queue = context.Queue()
    processes = [
        context.Process(
            target=_worker, args=(build, layout, options, share, queue, step_batch, pretrained), daemon=True
        )
        for share in shares
    ]
    for process in processes:
        process.start()
    reports: list[RankReport] = []
    deadline = time.monotonic() + timeout
    try:
        while len(reports) < len(ranks):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise RehearsalError(f"the rehearsal did not finish within {timeout:.0f} s")
            try:
                kind, payload = queue.get(timeout=min(remaining, 1.0))
            except Exception:  # noqa: BLE001 - an empty queue: look for a worker that died without a word
                dead = [p.exitcode for p in processes if p.exitcode not in (None, 0)]
                if dead:
                    raise RehearsalError(f"a rehearsal worker died with exit code {dead[0]}") from None
                continue
            if kind == "error":
                raise RehearsalError(payload)
            reports.append(payload)
    finally:
        for process in processes:
            process.join(timeout=1)
            if process.is_alive():
                process.kill()
                process.join()
    return sorted(reports, key=lambda report: report.rank)


def _worker(
    build: Callable[[], nn.Module],
    layout: ParallelLayout,
    options: ParallelOptions,
    ranks: list[int],
    queue: Any,
    step_batch: StepBatch | None,
    pretrained: Pretrained | None,
) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    # A pipeline cut copies the modules of other stages, meshes included; on the fake group the copy cannot look up
    # the process groups by name, and torch warns (for torch.compile's sake) once per mesh and rank.
    logging.getLogger("torch.distributed.device_mesh").addFilter(
        lambda record: "pickling/unpickling of the DeviceMesh" not in record.getMessage()
    )
    for rank in ranks:
        try:
            queue.put(("report", rehearse_rank(build, layout, options, rank, step_batch, pretrained)))
        except BaseException as error:  # noqa: BLE001 - every failure goes back to the parent, named
            message = f"{type(error).__name__}: {error}"
            if not isinstance(error, (ValueError, NotImplementedError, CheckpointError)):
                message += "\n" + traceback.format_exc()
            queue.put(("error", f"rank {rank} {coordinate(layout, rank)}: {message}"))
            return


def rehearse_rank(
    build: Callable[[], nn.Module],
    layout: ParallelLayout,
    options: ParallelOptions,
    rank: int,
    step_batch: StepBatch | None = None,
    pretrained: Pretrained | None = None,
) -> RankReport:
    """One rank of the job, in this process: fake process group, module on meta, the library's setup path (and,
    given ``step_batch``, one training step's collectives)."""
    import torch.distributed as dist
    from lightning.pytorch.plugins.precision import Precision

    from lightning_mgpu._compat.c10d import fake_store
    from lightning_mgpu.backends.torch_data_parallel import TorchDataParallel
    from lightning_mgpu.parallel import parallelize
    from lightning_mgpu.patches import PatchLog
    from lightning_mgpu.precision import HybridPrecision

    start = time.perf_counter()
    dist.init_process_group("fake", rank=rank, world_size=layout.world_size, store=fake_store())
    try:
        with torch.device("meta"):
            module = configured(build)
        weights = pretrained.map(module) if pretrained is not None else None  # names and shapes, whole module
        blocks = _block_names(module)
        mesh = layout.build_mesh("cpu")
        precision = HybridPrecision.from_lightning(Precision(), "cpu")
        patches = PatchLog()
        device, engine = torch.device("meta"), TorchDataParallel()
        run = parallelize(module, layout, mesh, options, precision, device, patches, engine)
        optimizers = optimizers_of(module)
        run.wire_optimizers(optimizers, module, layout, mesh, precision, patches)
        parameters = _unique(module.parameters())
        for parameter in parameters:
            if parameter.requires_grad:
                parameter.grad = torch.zeros_like(parameter)
        for optimizer in optimizers:
            optimizer.step()
        report = RankReport(
            rank=rank,
            coordinate=coordinate(layout, rank),
            parameter_bytes=sum(_local_bytes(p) for p in parameters),
            gradient_bytes=sum(_local_bytes(p) for p in parameters if p.requires_grad),
            optimizer_bytes=sum(_state_bytes(optimizer) for optimizer in optimizers),
            layers=[name for name, block in _named_blocks(module, blocks) if any(True for _ in block.parameters())],
        )
        if pretrained is not None and weights is not None:
            report.read_bytes = planned_read_bytes(module, pretrained.source, weights)
        patches.undo()  # as the strategy's teardown: torch's functions that context parallelism patched, back
        if step_batch is not None:
            report.collectives, report.collectives_note = count_step_collectives(build, layout, options, step_batch)
        report.seconds = time.perf_counter() - start
        return report
    finally:
        dist.destroy_process_group()


def _unique(parameters: Any) -> list[nn.Parameter]:
    seen: dict[int, nn.Parameter] = {}
    for parameter in parameters:
        seen.setdefault(id(parameter), parameter)
    return list(seen.values())


def _local_bytes(tensor: torch.Tensor) -> int:
    from torch.distributed.tensor import DTensor

    local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
    return local.numel() * local.element_size()


def _state_bytes(optimizer: torch.optim.Optimizer) -> int:
    return sum(
        _local_bytes(value)
        for state in optimizer.state.values()
        for value in state.values()
        if isinstance(value, torch.Tensor) and value.ndim > 0  # the step counters are scalars
    )


def _block_names(module: nn.Module) -> list[str]:
    """The names of the module's repeated blocks (before the pipeline cut leaves this rank its own)."""
    from lightning_mgpu.parallel.blocks import find_block_container

    found = find_block_container(module)
    if found is None:
        return []
    name, blocks = found
    keys = list(blocks.keys()) if isinstance(blocks, nn.ModuleDict) else [str(i) for i in range(len(blocks))]
    return [f"{name}.{key}" if name else key for key in keys]


def _named_blocks(module: nn.Module, names: list[str]) -> list[tuple[str, nn.Module]]:
    """Those of ``names`` still in ``module`` (the pipeline cut removes other stages' blocks or leaves stand-ins)."""
    found = []
    for name in names:
        try:
            found.append((name, module.get_submodule(name)))
        except AttributeError:
            continue
    return found


# ------------------------------------------------------------------------------------------ beside the planner
def predicted_bytes(model: ModelSpec, training: Training, layout: Layout) -> dict[str, dict[str, float]]:
    """The planner's parameter, gradient and optimizer bytes per rank for each kind of pipeline stage (``only``
    without a pipeline; ``first``, ``middle``, ``last`` with one): the cost model's own formulas."""
    return state_bytes(model, training, layout)


def stage_kind(pp_coordinate: int, pp: int) -> str:
    if pp == 1:
        return "only"
    return "first" if pp_coordinate == 0 else "last" if pp_coordinate == pp - 1 else "middle"


def beside_the_planner(reports: list[RankReport], predicted: dict[str, dict[str, float]], pp: int) -> list[dict]:
    """Each rank's report as a dict, with the planner's prediction for its stage and the relative difference."""
    rows = []
    for report in reports:
        row = report.as_dict()
        expected = predicted[stage_kind(report.coordinate.get("pp", 0), pp)]
        row["predicted"] = {kind: expected[kind] for kind in STATE_KINDS}
        row["difference"] = {
            kind: (getattr(report, kind) - expected[kind]) / expected[kind] if expected[kind] else 0.0
            for kind in STATE_KINDS
        }
        rows.append(row)
    return rows


def _reads(row: dict, shown: bool) -> str:
    return f" {(row.get('read_bytes') or 0) / 2**30:>9.3f}" if shown else ""


def format_rehearsal(rows: list[dict], describe: str, seconds: float) -> str:
    """A table: rank, mesh coordinate, GiB held (and the planner's difference), blocks of its stage."""
    gib = 2**30
    axes = [axis for axis in ("pp", "dp", "cp", "tp") if axis in rows[0]] if rows else []
    reads = any(row.get("read_bytes") is not None for row in rows)
    head = " ".join(f"{axis:>3}" for axis in axes)
    lines = [
        f"rehearsed {len(rows)} ranks of {describe} in {seconds:.0f} s (meta tensors, torch's fake process group)",
        "",
        f"{'rank':>5} {head}  {'params GiB':>10} {'grads GiB':>9} {'optim GiB':>9}  {'vs planner (p/g/o)':<22}"
        f"{' reads GiB' if reads else ''} blocks",
    ]
    for row in rows:
        coordinate = " ".join(f"{row[axis]:>3}" for axis in axes)
        difference = "/".join(f"{row['difference'][kind]:+.1%}" for kind in STATE_KINDS)
        layers = row["layers"]
        blocks = f"{layers[0]} .. {layers[-1]} ({len(layers)})" if layers else "-"
        lines.append(
            f"{row['rank']:>5} {coordinate}  {row['parameter_bytes'] / gib:>10.3f} {row['gradient_bytes'] / gib:>9.3f}"
            f" {row['optimizer_bytes'] / gib:>9.3f}  {difference:<22}{_reads(row, reads)} {blocks}"
        )
    stepped = [row for row in rows if row.get("collectives") is not None or row.get("collectives_note")]
    if stepped:
        lines += ["", "collectives of one training step, by mesh axis (calls, bytes of their largest buffers):"]
        notes = {row["collectives_note"] for row in stepped if row["collectives"] is None}
        if len(notes) == 1 and all(row["collectives"] is None for row in stepped):
            lines.append(f"  every rank: {notes.pop()}")  # one reason, said once
            return "\n".join(lines)
        for row in stepped:
            coordinate = ", ".join(f"{axis} {row[axis]}" for axis in axes)
            counted = row["collectives"]
            said = describe_collectives(counted) if counted is not None else row["collectives_note"]
            lines.append(f"{row['rank']:>5} ({coordinate}): {said}")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------------- command
def run_rehearsal(
    args: Any, model: ModelSpec, cluster: ClusterSpec, training: Training, fixed: dict[str, object]
) -> int:
    """``lightning-mgpu plan --module ... --fix tp=,pp=,zero= --rehearse [--json]`` (see ``cli/plan.py``)."""
    import json

    if not args.module:
        raise ValueError("--rehearse plays the real module: give --module pkg.mod:Class.")
    sizes = {key: int(fixed.get(key, 1)) for key in ("tp", "pp", "cp", "ep")}  # type: ignore[call-overload]
    zero = int(fixed.get("zero_stage", 0))  # type: ignore[call-overload]
    shard = fixed.get("dp_shard")
    inner = sizes["tp"] * sizes["pp"] * sizes["cp"]
    if cluster.gpus % inner:
        raise ValueError(
            f"tp x pp x cp = {inner} does not divide the {cluster.gpus} GPUs (--gpus): fix --fix or --gpus."
        )
    layout = ParallelLayout(
        cluster.gpus // inner,
        sizes["tp"],
        sizes["pp"],
        zero,
        sizes["cp"],
        sizes["ep"],
        int(shard) if shard is not None else None,  # type: ignore[call-overload]
    )
    options = ParallelOptions(
        sequence_parallel=bool(fixed.get("sequence_parallel", False)) and sizes["tp"] > 1,
        pipeline_schedule=str(fixed.get("pipeline_schedule", ParallelOptions.pipeline_schedule)),
    )
    kwargs = json.loads(args.init_args) if args.init_args else {}  # valid JSON: spec_from_path read it already
    cls = load_class(args.module)
    build_on_meta(cls, kwargs)  # fails here, once, where the class cannot be built at all
    start = time.perf_counter()
    try:
        _check_like_the_strategy(layout, options)
        micro = max(1, training.global_batch // layout.data_parallel_size)  # one step's sequences per rank
        # Activations in the planned precision's dtype (fp8 and fp16 runs move 16-bit activations as bf16 does).
        precision = training.precision if training.precision in ("32-true", "bf16-mixed", "bf16-true") else "bf16-mixed"
        step_batch = StepBatch(micro, model.seq_len, model.vocab, precision)
        weights = None
        if getattr(args, "pretrained", None):
            weights = Pretrained(open_weights(args.pretrained), strict=args.pretrained_strict)
        reports = rehearse(_Builder(cls, kwargs), layout, options, step_batch=step_batch, pretrained=weights)
    except (ValueError, NotImplementedError, RehearsalError, CheckpointError) as error:
        raise ValueError(f"--rehearse: {layout.describe()} would fail: {error}") from None
    seconds = time.perf_counter() - start
    planner_layout = Layout.from_strategy(layout, options, microbatching_for(layout, options, training.global_batch))
    rows = beside_the_planner(reports, predicted_bytes(model, training, planner_layout), sizes["pp"])
    if args.json:
        print(json.dumps({"layout": layout.describe(), "world_size": layout.world_size, "seconds": seconds,
                          "ranks": rows}, indent=1))  # fmt: skip
    else:
        print(format_rehearsal(rows, layout.describe(), seconds))
    return 0


class _Builder:
    """``cls(**kwargs)``: picklable, for the workers."""

    def __init__(self, cls: type, kwargs: dict[str, Any]) -> None:
        self.cls, self.kwargs = cls, kwargs

    def __call__(self) -> nn.Module:
        return self.cls(**self.kwargs)


def _check_like_the_strategy(layout: ParallelLayout, options: ParallelOptions) -> None:
    """The checks ``HybridStrategy`` runs when the Trainer is built, on this layout."""
    from lightning_mgpu.layout_checks import check_options, check_sizes

    sizes = (layout.data_parallel_size, layout.tensor_parallel_size, layout.pipeline_parallel_size, layout.zero_stage)
    check_options(options, layout.zero_stage, sizes[1], sizes[2], layout.context_parallel_size)
    check_sizes(options, "32-true", sizes, layout)
