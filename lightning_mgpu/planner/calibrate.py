"""``plan --calibrate``: measure this machine and feed the numbers to the cost model instead of a GPU preset.

Measured here, in this process and in two forked gloo processes:

- achieved FLOP/s: a few forward + backward steps of the real module (``--module``, when it is small enough to build
  on this machine) or of one transformer block of the model's shape, timed; FLOPs counted as the cost model counts
  them, so the measured rate already includes the elementwise work (``memory_passes`` is set to 0);
- memory bandwidth: a large tensor copy;
- collective bandwidth and latency: gloo all-reduces of a small and a large tensor between two processes.

Processes beyond the machine's cores share them: each gets ``cores / processes`` of the measured rates.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import time
from dataclasses import dataclass, replace
from typing import Any, Callable, Optional

import torch

from lightning_mgpu.planner.cluster import GB, ClusterSpec, Efficiency
from lightning_mgpu.planner.model_spec import ModelSpec

MAX_CALIBRATION_PARAMS = 200_000_000  # larger real modules are measured one block at a time


def _best_time(fn: Callable[[], Any], repeats: int = 5) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)  # the least disturbed run: other jobs only ever add time


def measure_flops(model: ModelSpec, module: Optional[torch.nn.Module] = None, batch: int = 2) -> float:
    """FLOP/s of forward + backward on one process, counted as ``cost.step_time`` counts them."""
    seq = min(model.seq_len, 128)
    block_flops, head_flops = model.forward_flops_per_token()
    if module is not None:
        tokens = torch.randint(0, model.vocab, (batch, seq))

        def step() -> None:
            out = module(tokens)
            (out.float().mean() if torch.is_tensor(out) else out[0].float().mean()).backward()

        per_token = model.layers * block_flops + head_flops
    else:  # one block of the model's shape, narrowed to at most 1024 wide so that it fits any machine
        shrink = max(1, model.hidden // 1024)
        heads = max(1, model.heads // shrink)
        model = replace(model, hidden=model.hidden // shrink // heads * heads, heads=heads, kv_heads=None,
                        ffn_hidden=model.ffn // shrink, gated_mlp=False, block_params=None)
        block_flops, head_flops = model.forward_flops_per_token()
        layer = torch.nn.TransformerEncoderLayer(model.hidden, model.heads, model.ffn, batch_first=True, dropout=0.0)
        x = torch.randn(batch, seq, model.hidden)

        def step() -> None:
            layer(x).mean().backward()

        per_token = block_flops
    # The attention term of the FLOP count uses the calibration's sequence length, not the model's.
    per_token -= 4.0 * (model.seq_len - seq) * model.hidden * (model.layers if module is not None else 1)
    return 3 * per_token * batch * seq / _best_time(step, repeats=3)


def measure_memory_bandwidth(nbytes: int = 256 * 2**20) -> float:
    """Bytes/s of a copy (each byte read once and written once)."""
    src = torch.empty(nbytes // 4, dtype=torch.float32).fill_(1.0)
    dst = torch.empty_like(src)
    return 2 * nbytes / _best_time(lambda: dst.copy_(src))


def _allreduce_worker(rank: int, port: int, queue: Any, sizes: list[int]) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        results = []
        for size in sizes:
            tensor = torch.ones(size // 4)
            results.append(_best_time(lambda: dist.all_reduce(tensor), repeats=5))
        if rank == 0:
            queue.put(results)
    finally:
        dist.destroy_process_group()


def measure_collectives(small: int = 4096, large: int = 16 * 2**20) -> tuple[float, float]:
    """(latency in s, bus bandwidth in bytes/s) of gloo all-reduce between two forked processes."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    ctx = mp.get_context("fork")
    queue = ctx.Queue()
    workers = [ctx.Process(target=_allreduce_worker, args=(r, port, queue, [small, large]), daemon=True)
               for r in range(2)]
    for worker in workers:
        worker.start()
    try:
        t_small, t_large = queue.get(timeout=120)
    finally:
        for worker in workers:
            worker.join(timeout=30)
            if worker.is_alive():
                worker.kill()
    # A 2-rank ring moves the whole tensor once each way: 2 (n-1)/n * bytes = bytes per link.
    return t_small, large / max(t_large - t_small, 1e-9)


def cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


@dataclass(frozen=True)
class Measurements:
    """This machine, one process at a time: FLOP/s, memory bytes/s, gloo latency (s) and bus bytes/s."""

    flops: float
    memory_bw: float
    latency: float
    bus_bw: float
    memory_gb: float
    cores: int

    def as_cluster(self, processes: int) -> tuple[ClusterSpec, Efficiency]:
        """The machine as ``processes`` "devices" sharing its cores, and the matching efficiencies."""
        share = min(1.0, self.cores / processes)
        cluster = ClusterSpec(gpus=processes, gpus_per_node=processes, memory_gb=self.memory_gb / processes,
                              peak_tflops=self.flops * share / 1e12, intra_node_gbps=self.bus_bw * share / GB,
                              inter_node_gbps=self.bus_bw * share / GB, hbm_gbps=self.memory_bw * share / GB,
                              reserved_gb=0.0, name="this-machine")
        efficiency = Efficiency(gemm=1.0, memory_passes=0.0, comm=1.0, dp_overlap=0.0, latency_s=self.latency / share,
                                source=f"calibrated here ({self.flops / 1e9:.2f} GFLOP/s, {self.memory_bw / GB:.1f}"
                                f" GB/s memory, gloo {self.bus_bw / GB:.2f} GB/s + {self.latency * 1e6:.0f} us per"
                                f" process; {self.cores} cores for {processes} processes)")
        return cluster, efficiency


def measure(model: ModelSpec, module: Optional[torch.nn.Module] = None) -> Measurements:
    """Everything :class:`Measurements` holds, with one intra-op thread as each training process uses."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        flops = measure_flops(model, module)
        memory_bw = measure_memory_bandwidth()
    finally:
        torch.set_num_threads(threads)
    latency, bus_bw = measure_collectives()
    try:
        total_gb = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GB
    except (ValueError, OSError):
        total_gb = 16.0
    return Measurements(flops, memory_bw, latency, bus_bw, total_gb, cores())


def calibrate(args: argparse.Namespace, cluster: ClusterSpec, model: ModelSpec) -> tuple[ClusterSpec, Efficiency]:
    """Measure this machine for ``lightning-mgpu plan --calibrate``; ``--gpus`` is the number of processes."""
    module = None
    if args.module and model.total_params <= MAX_CALIBRATION_PARAMS:
        from lightning_mgpu.planner.model_spec import load_class

        torch.manual_seed(0)
        module = load_class(args.module)(**(json.loads(args.init_args) if args.init_args else {}))
        if hasattr(module, "configure_model"):
            module.configure_model()
    return measure(model, module).as_cluster(args.gpus or cores())
