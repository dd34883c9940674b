"""``plan --calibrate``: measure this machine and feed the numbers to the cost model instead of a GPU preset.

On CPU a small model's step is mostly fixed costs, not FLOPs: operator dispatch, DTensor's sharding logic, FSDP2's
hooks, gloo's latency, and processes queueing for too few cores. Each is measured on the real module (a copy: the
user's module, its gradients and the random state are left as they were):

- in this process, one intra-op thread as each training process uses: forward + backward at two batch sizes, whose
  difference is the achieved FLOP/s at the model's shapes and whose intercept is the dispatch overhead per block;
  an AdamW step (the per-step overhead); a large copy (memory bandwidth);
- in ``processes`` forked gloo processes at once: the same forward + backward (how much slower each runs when they
  share the cores: the effective number of cores), all-reduces of a small and a large tensor (latency, bandwidth),
  the module under this library's tensor parallelism (what DTensor adds per block) and under its ZeRO-3 wrap
  (what each FSDP2 collective adds, and what an optimizer step on DTensor parameters adds), and torch's 1F1B
  schedule over pairs of processes (what each microbatch costs a stage besides its compute).

Everything is stored for one process on a core of its own; the cost model slows it down by
``ClusterSpec.contention`` for the layout's own number of processes. Without a module (flags, or a model over
``MAX_CALIBRATION_PARAMS``) only one transformer block of the model's shape is timed, and the tensor-parallel and
FSDP2 terms stay 0. :func:`quick_measure` is the in-process part alone (what ``"auto"`` sizes use at setup).
"""

from __future__ import annotations

import argparse
import copy
import functools
import json
import multiprocessing as mp
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, TypeVar

import torch
from torch import nn

from lightning_mgpu.launch import free_port
from lightning_mgpu.layout import DP_AXIS, TP_AXIS
from lightning_mgpu.planner.cluster import GB, ClusterSpec, Efficiency
from lightning_mgpu.planner.model_spec import ModelSpec

if TYPE_CHECKING:
    from multiprocessing.queues import Queue

    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.pipelining import Schedule1F1B

_T = TypeVar("_T")

MAX_CALIBRATION_PARAMS = 200_000_000  # larger real modules are measured one block at a time
BATCHES, LARGE = (1, 4, 8), 4  # batch sizes of the timed forward + backward passes; the one the workers run
# Where the forked probes are not run (``quick_measure``): what ``measure`` found on this repository's 2-core CI
# machine for the demo GPT (4 blocks, 64 wide; docs/benchmarks.md): gloo per process on a core of its own, and the
# DTensor, FSDP2, DTensor-optimizer and pipeline terms as multiples of the per-block dispatch overhead (0.5-0.75 ms
# there; medians of three calibrations), so that they follow the speed of the machine at hand, which
# ``quick_measure`` measures.
DOCUMENTED = {
    "latency": 450e-6,
    "bus_bw": 4 * GB,
    "tp_layer": 22.0,
    "shard_collective": 2.4,
    "sharded_step": 0.0,  # AdamW steps on the local shards (parallel/local_step.py): measured +0.00 ms
    "microbatch": 1.0,
}


def _best_time(fn: Callable[[], object], repeats: int = 5) -> float:
    """The least disturbed wall time of ``fn`` (other jobs only ever add time)."""
    return _best_times(fn, repeats)[0]


def _best_times(fn: Callable[[], object], repeats: int = 5) -> tuple[float, float]:
    """(wall, CPU) seconds of ``fn``, each the least of ``repeats`` runs after a warm-up. CPU time is this process's
    own work, which other jobs on the machine do not change; wall time includes waiting for cores and peers."""
    fn()
    walls, cpus = [], []
    for _ in range(repeats):
        wall, cpu = time.perf_counter(), time.process_time()
        fn()
        walls.append(time.perf_counter() - wall)
        cpus.append(time.process_time() - cpu)
    return min(walls), min(cpus)


def _scalar(out: Any) -> torch.Tensor:
    tensor = out if torch.is_tensor(out) else getattr(out, "logits", None)
    tensor = tensor if tensor is not None else out[0]
    return tensor.float().mean()


def _forward_backward(module: nn.Module, inputs: torch.Tensor) -> Callable[[], None]:
    def step() -> None:
        _scalar(module(inputs)).backward()

    return step


@dataclass
class _Probe:
    """What is timed: the module (or a block of the model's shape) and its inputs at batch ``b``."""

    module: nn.Module
    layers: int
    flops_per_sample: float  # forward + backward, counted as ``cost.step_time`` counts them
    make_inputs: Callable[[int], torch.Tensor]
    whole: bool  # the real module (the tensor-parallel and FSDP2 probes apply to it)


def _probe(model: ModelSpec, module: nn.Module | None) -> _Probe:
    seq = min(model.seq_len, 128)
    block_flops, head_flops = model.forward_flops_per_token()
    if module is not None:
        per_token = model.layers * block_flops + head_flops
        # The attention term of the FLOP count uses the calibration's sequence length, not the model's.
        per_token -= 4.0 * (model.seq_len - seq) * model.hidden * model.layers
        return _Probe(
            copy.deepcopy(module).train(),
            model.layers,
            3 * per_token * seq,
            lambda b: torch.randint(0, model.vocab, (b, seq)),
            True,
        )
    # One block of the model's shape, narrowed to at most 1024 wide so that it fits any machine.
    shrink = max(1, model.hidden // 1024)
    heads = max(1, model.heads // shrink)
    narrow = replace(
        model,
        hidden=model.hidden // shrink // heads * heads,
        heads=heads,
        kv_heads=None,
        ffn_hidden=model.ffn // shrink,
        gated_mlp=False,
        block_params=None,
        experts=0,  # the probe is one dense block
        experts_per_token=None,
        expert_params=0,
        fused_experts=False,
    )
    layer = nn.TransformerEncoderLayer(narrow.hidden, narrow.heads, narrow.ffn, batch_first=True, dropout=0.0)
    per_token = narrow.forward_flops_per_token()[0] - 4.0 * (narrow.seq_len - seq) * narrow.hidden
    return _Probe(layer, 1, 3 * per_token * seq, lambda b: torch.randn(b, seq, narrow.hidden), False)


@dataclass(frozen=True)
class Measurements:
    """This machine for one model, per process on a core of its own (see the module's docstring)."""

    flops: float  # FLOP/s at the model's shapes
    memory_bw: float  # bytes/s
    latency: float  # s per gloo collective
    bus_bw: float  # bytes/s per link
    memory_gb: float
    cores: int  # the machine's
    busy: float = 0.0  # cores other jobs kept busy while it was measured
    layer_overhead: float = 0.0
    tp_layer_overhead: float = 0.0
    shard_collective: float = 0.0
    step_overhead: float = 0.0
    sharded_step_overhead: float = 0.0
    microbatch_overhead: float = 0.0
    how: str = "measured"

    def as_cluster(self, processes: int) -> tuple[ClusterSpec, Efficiency]:
        """The machine as ``processes`` "devices" sharing its cores, and the matching efficiencies."""
        cluster = ClusterSpec(
            gpus=processes,
            gpus_per_node=processes,
            memory_gb=self.memory_gb / processes,
            peak_tflops=self.flops / 1e12,
            intra_node_gbps=self.bus_bw / GB,
            inter_node_gbps=self.bus_bw / GB,
            hbm_gbps=self.memory_bw / GB,
            reserved_gb=0.0,
            name="this-machine",
            cores_per_node=float(self.cores),
            busy_cores=self.busy,
        )
        efficiency = Efficiency(
            gemm=1.0,
            memory_passes=0.0,
            comm=1.0,
            dp_overlap=0.0,
            latency_s=self.latency,
            layer_overhead_s=self.layer_overhead,
            tp_layer_overhead_s=self.tp_layer_overhead,
            shard_collective_s=self.shard_collective,
            step_overhead_s=self.step_overhead,
            sharded_step_overhead_s=self.sharded_step_overhead,
            microbatch_overhead_s=self.microbatch_overhead,
            source=f"calibrated here, {self.how} ({self.flops / 1e9:.2f} GFLOP/s, {self.layer_overhead * 1e3:.2f} ms"
            f" dispatch per block, +{self.tp_layer_overhead * 1e3:.2f} ms under tp, +{self.shard_collective * 1e3:.2f}"
            f" ms per FSDP2 collective, +{self.sharded_step_overhead * 1e3:.2f} ms per step on DTensor parameters,"
            f" +{self.microbatch_overhead * 1e3:.2f} ms per pipeline microbatch, {self.step_overhead * 1e3:.2f} ms"
            f" optimizer step, gloo {self.bus_bw / GB:.2f} GB/s + {self.latency * 1e6:.0f} us per process;"
            f" {processes} processes on {self.cores} cores, {self.busy:.2g} of them busy with other work)",
        )
        return cluster, efficiency


def _physical_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def _memory_gb() -> float:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GB
    except (ValueError, OSError):
        return 16.0


def _local(probe: _Probe) -> dict[str, float]:
    """The in-process measurements, one thread, on the probe."""
    wall_times, cpus = zip(*(_best_times(_forward_backward(probe.module, probe.make_inputs(b)), 7) for b in BATCHES))
    times, walls = dict(zip(BATCHES, cpus)), dict(zip(BATCHES, wall_times))
    # CPU time against batch size, a least-squares line: slope = compute per sample, intercept = dispatch.
    mean_b, mean_t = sum(BATCHES) / len(BATCHES), sum(cpus) / len(cpus)
    slope = sum((b - mean_b) * (t - mean_t) for b, t in times.items()) / sum((b - mean_b) ** 2 for b in BATCHES)
    per_sample = max(slope, 0.1 * times[LARGE] / LARGE)
    intercept = max(0.0, mean_t - per_sample * mean_b)
    optimizer = torch.optim.AdamW(probe.module.parameters())
    step = _best_times(optimizer.step)[1]
    src = torch.ones(2**24)
    dst = torch.empty_like(src)
    memory_bw = 2 * src.numel() * 4 / _best_time(lambda: dst.copy_(src))
    return {
        "flops": probe.flops_per_sample / per_sample,
        "per_sample": per_sample,
        "time_large": times[LARGE],
        "wall_large": walls[LARGE],
        "layer_overhead": intercept / (probe.layers + 1) if probe.whole else intercept,
        "step_overhead": step,
        "memory_bw": memory_bw,
    }


def _isolated(fn: Callable[[], _T]) -> _T:
    """Run ``fn`` with one intra-op thread and the random state restored afterwards."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with torch.random.fork_rng(devices=[]):
            return fn()
    finally:
        torch.set_num_threads(threads)


_QUICK: dict[tuple[str | None, ModelSpec], Measurements] = {}  # by (the module's class, its shape)


def _quick(model: ModelSpec, module: nn.Module | None) -> Measurements:
    local = _isolated(lambda: _local(_probe(model, module)))
    base = local["layer_overhead"]
    cores = _physical_cores()
    busy = max(0.0, cores * local["wall_large"] / local["time_large"] - 1)
    return Measurements(
        local["flops"],
        local["memory_bw"],
        DOCUMENTED["latency"],
        DOCUMENTED["bus_bw"],
        _memory_gb(),
        cores,
        busy,
        base,
        DOCUMENTED["tp_layer"] * base,
        DOCUMENTED["shard_collective"] * base,
        local["step_overhead"],
        DOCUMENTED["sharded_step"] * base,
        DOCUMENTED["microbatch"] * base,
        how="quick (gloo and DTensor terms from documented rates)",
    )


def quick_measure(model: ModelSpec, module: nn.Module | None = None) -> Measurements:
    """The in-process measurements on a copy of ``module``, cached per model shape in this process (about a
    second); gloo, DTensor and FSDP2 terms from :data:`DOCUMENTED` rates scaled by the measured dispatch cost."""
    real = (
        module is not None
        and model.total_params <= MAX_CALIBRATION_PARAMS
        and not any(p.is_meta for p in module.parameters())
    )
    key = (type(module).__name__ if real else None, model)
    if key not in _QUICK:
        try:
            _QUICK[key] = _quick(model, module if real else None)
        except Exception:  # noqa: BLE001 - a forward that takes no token ids: a block of the model's shape instead
            _QUICK[key] = _quick(model, None)
    return _QUICK[key]


# ------------------------------------------------------------------ the forked part: what processes add together
def _tp_degree(processes: int, heads: int) -> int:
    """The smallest tensor-parallel degree the probe can run (2 where it can): the common one inside a node."""
    return min([t for t in range(2, processes + 1) if processes % t == 0 and heads % t == 0], default=1)


def _worker(rank: int, world: int, port: int, queue: Queue[Mapping[str, object]], probe: _Probe, heads: int) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        torch.manual_seed(0)
        inputs = probe.make_inputs(LARGE)
        dist.barrier()
        out: dict[str, float] = {}
        out["together"], out["plain_cpu"] = _best_times(_forward_backward(probe.module, inputs))
        for name, numel in (("small", 1024), ("large", 2**20)):
            tensor = torch.ones(numel)
            out[name] = _best_time(functools.partial(dist.all_reduce, tensor))
        plain_step = _best_times(torch.optim.AdamW(probe.module.parameters()).step)[1]
        out["microbatch"] = _pipeline_probe(rank, world)
        if probe.whole:
            out.update(_parallel_probes(probe, inputs, world, heads, plain_step, init_device_mesh))
        if rank == 0:
            queue.put(out)
    except BaseException as error:  # noqa: BLE001 - reported to the parent, which carries on without these terms
        if rank == 0:
            queue.put({"error": f"{type(error).__name__}: {error}"})
    finally:
        dist.destroy_process_group()


def _pipeline_probe(rank: int, world: int, few: int = 2, many: int = 6) -> float:
    """CPU seconds a pipeline schedule spends per microbatch and stage beyond the stage's own compute: torch's 1F1B
    over pairs of ranks with a stage too small to cost anything, stepped with ``few`` and ``many`` microbatches."""
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    groups = [dist.new_group([r, r + 1]) for r in range(0, world - 1, 2)]  # every rank creates every group
    if rank >= 2 * len(groups):
        return 0.0
    index = rank % 2
    stage = PipelineStage(nn.Linear(8, 8), index, 2, torch.device("cpu"), group=groups[rank // 2])
    inputs, target = torch.randn(2 * many, 8), torch.randn(2 * many, 8)
    times = {}
    for count in (few, many):
        schedule = Schedule1F1B(stage, count, loss_fn=lambda out, y: (out - y).pow(2).mean())

        def step(count: int = count, schedule: Schedule1F1B = schedule) -> None:
            batch = 2 * count
            if index == 0:
                schedule.step(inputs[:batch])
            else:
                schedule.step(target=target[:batch], losses=[])

        times[count] = _best_times(step, 3)[1]
    return max(0.0, (times[many] - times[few]) / (many - few))


def _parallel_probes(
    probe: _Probe,
    inputs: torch.Tensor,
    world: int,
    heads: int,
    plain_step: float,
    init_device_mesh: Callable[..., DeviceMesh],
) -> dict[str, float]:
    from lightning_mgpu.parallel import data, tensor
    from lightning_mgpu.parallel.local_step import ShardLocalStep, steps_on_shards

    out: dict[str, float] = {}
    tp = _tp_degree(world, heads)
    if tp > 1:
        mesh = init_device_mesh("cpu", (world // tp, tp), mesh_dim_names=(DP_AXIS, TP_AXIS))
        module = copy.deepcopy(probe.module)
        tensor.apply(module, mesh[TP_AXIS], "auto", False)
        out["tp"], out["tp_degree"] = _best_times(_forward_backward(module, inputs), 3)[1], tp
    module = copy.deepcopy(probe.module)
    data.apply(module, init_device_mesh("cpu", (world,), mesh_dim_names=(DP_AXIS,)), 3)
    out["zero3"] = _best_times(_forward_backward(module, inputs), 3)[1]
    optimizer = torch.optim.AdamW(module.parameters())
    if steps_on_shards(optimizer):  # stepped as the library steps it: on the local shards
        ShardLocalStep(optimizer)
    out["sharded_step"] = _best_times(optimizer.step)[1] - plain_step
    return out


def _forked(probe: _Probe, processes: int, heads: int, timeout: float = 180) -> dict[str, float]:
    port = free_port()
    ctx = mp.get_context("fork")
    queue = ctx.Queue()
    workers = [
        ctx.Process(target=_worker, args=(r, processes, port, queue, probe, heads), daemon=True)
        for r in range(processes)
    ]
    for worker in workers:
        worker.start()
    try:
        return queue.get(timeout=timeout)
    finally:
        for worker in workers:
            worker.join(timeout=30)
            if worker.is_alive():
                worker.kill()


def measure(model: ModelSpec, module: nn.Module | None = None, processes: int = 2) -> Measurements:
    """Everything :class:`Measurements` holds, measured here (``processes`` >= 2 forked gloo processes)."""
    probe = _probe(model, module if module is not None and model.total_params <= MAX_CALIBRATION_PARAMS else None)
    local = _isolated(lambda: _local(probe))
    together = _forked(probe, max(2, processes), model.heads)
    if "error" in together:
        raise RuntimeError(f"plan --calibrate: the gloo probes failed: {together['error']}")
    n, cores = max(2, processes), _physical_cores()
    # Other jobs' load: how much longer than its CPU time the pass took, alone here and n at once in the workers.
    busy = (
        max(0.0, cores * local["wall_large"] / local["time_large"] - 1)
        + max(0.0, cores * together["together"] / together["plain_cpu"] - n)
    ) / 2
    slowdown = max(1.0, (n + busy) / cores)
    # A 2-rank ring moves the whole tensor once each way; n ranks 2 (n-1)/n of it per link.
    latency = together["small"] / slowdown
    bus_bw = 2 * (n - 1) / n * 2**20 * 4 / max(together["large"] - together["small"], 1e-9) * slowdown
    # The parallel probes' extra CPU time over the plain pass (the same processes, the same batch), per block.
    compute = LARGE * local["per_sample"]
    tp_layer = shard = sharded_step = 0.0
    microbatch = together.get("microbatch", 0.0)
    if "tp" in together:
        extra = together["tp"] - together["plain_cpu"] + compute * (1 - 1 / together["tp_degree"])
        tp_layer = max(0.0, extra / model.layers)
    if "zero3" in together:
        shard = max(0.0, (together["zero3"] - together["plain_cpu"]) / (3 * (model.layers + 1)))
        sharded_step = max(0.0, together["sharded_step"])
    how = "full" if probe.whole else "one block, no tp/FSDP2 probes"
    return Measurements(
        local["flops"],
        local["memory_bw"],
        latency,
        bus_bw,
        _memory_gb(),
        cores,
        busy,
        local["layer_overhead"],
        tp_layer,
        shard,
        local["step_overhead"],
        sharded_step,
        microbatch,
        how=how,
    )


def calibrate(args: argparse.Namespace, cluster: ClusterSpec, model: ModelSpec) -> tuple[ClusterSpec, Efficiency]:
    """Measure this machine for ``lightning-mgpu plan --calibrate``; ``--gpus`` is the number of processes."""
    module = None
    if args.module and model.total_params <= MAX_CALIBRATION_PARAMS:
        from lightning_mgpu.planner.model_spec import load_class

        torch.manual_seed(0)
        module = load_class(args.module)(**(json.loads(args.init_args) if args.init_args else {}))
        if hasattr(module, "configure_model"):
            module.configure_model()
    processes = args.gpus or _physical_cores()
    return measure(model, module, processes).as_cluster(processes)
