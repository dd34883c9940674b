"""What the planner needs to know about the machines: GPUs, memory, peak FLOP/s, link bandwidths, and how much of
each peak real kernels reach (:class:`Efficiency`, from defaults or from ``plan --calibrate``).

Bandwidths are GB/s (gigabytes) per GPU in one direction: what one GPU can push to its peers inside a node
(NVLink/NVSwitch) and to other nodes (its share of the node's network adapters).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from lightning_mgpu.gpus import GPUS

GB = 1e9
FP8_SPEEDUP = 2.0  # fp8 tensor cores' dense peak over the 16-bit one, on every GPU of the table that has them


@dataclass(frozen=True)
class ClusterSpec:
    gpus: int
    gpus_per_node: int
    memory_gb: float
    peak_tflops: float
    intra_node_gbps: float
    inter_node_gbps: float
    hbm_gbps: float = 2000.0
    reserved_gb: float = 1.5  # CUDA context, NCCL buffers, allocator slack that training cannot use
    name: str = "custom"
    # CPU processes: the cores a node's processes share with ``busy_cores`` of other jobs' work; with more of both
    # than cores every process runs ``(processes + busy) / cores`` times slower. None: a device each (GPUs).
    cores_per_node: float | None = None
    busy_cores: float = 0.0  # cores other jobs keep busy on each node (CPU; measured by ``plan --calibrate``)
    # fp8 matmuls' peak over ``peak_tflops`` (0: no fp8 tensor cores; CPU processes emulate fp8 at the 16-bit rate)
    fp8_speedup: float = 0.0

    def __post_init__(self) -> None:
        for name in ("gpus", "gpus_per_node"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"`--{name.replace('_', '-')}` must be a positive integer, got {value!r}.")
        for name in ("memory_gb", "peak_tflops", "intra_node_gbps", "inter_node_gbps", "hbm_gbps"):
            if not getattr(self, name) > 0:
                raise ValueError(f"`--{name.replace('_', '-')}` must be positive, got {getattr(self, name)!r}.")
        if self.cores_per_node is not None and not self.cores_per_node > 0:
            raise ValueError(f"`cores_per_node` must be positive, got {self.cores_per_node!r}.")
        if self.gpus > self.gpus_per_node and self.gpus % self.gpus_per_node:
            raise ValueError(
                f"--gpus {self.gpus} is not a whole number of nodes of {self.gpus_per_node} GPUs:"
                f" use a multiple of {self.gpus_per_node}."
            )

    def peak_flops(self, precision: str) -> float:
        """FLOP/s of the matmuls at ``precision``'s peak: fp8's where the GPUs have fp8 tensor cores."""
        speedup = self.fp8_speedup if precision == "fp8-mixed" and self.fp8_speedup else 1.0
        return self.peak_tflops * 1e12 * speedup

    def check_precision(self, precision: str) -> None:
        """fp8 matmuls need fp8 tensor cores (torchao's float8 training refuses other GPUs); CPU processes emulate
        them."""
        if precision == "fp8-mixed" and not self.fp8_speedup and self.cores_per_node is None and self.name != "cpu":
            capable = ", ".join(gpu.preset for gpu in GPUS if gpu.fp8)
            raise ValueError(
                f"--precision fp8-mixed needs fp8 tensor cores, which {self.name} lacks (they are on {capable}):"
                " plan with --precision bf16-mixed, or choose another --gpu."
            )

    @property
    def nodes(self) -> int:
        return max(1, self.gpus // self.gpus_per_node)

    @property
    def usable_bytes(self) -> float:
        return (self.memory_gb - self.reserved_gb) * GB

    @property
    def contention(self) -> float:
        """How many times slower each process runs because the node's processes share fewer cores (1 on GPUs)."""
        if self.cores_per_node is None:
            return 1.0
        return max(1.0, (min(self.gpus, self.gpus_per_node) + self.busy_cores) / self.cores_per_node)

    def one_node(self) -> ClusterSpec:
        return replace(self, gpus=min(self.gpus, self.gpus_per_node))

    def describe(self) -> str:
        return (
            f"{self.gpus} x {self.name} ({self.nodes} node{'s' if self.nodes > 1 else ''} of {self.gpus_per_node},"
            f" {self.memory_gb:.4g} GB, {self.peak_tflops:.4g} TFLOP/s, {self.intra_node_gbps:.4g} GB/s in a node,"
            f" {self.inter_node_gbps:.4g} GB/s across nodes per GPU)"
        )


@dataclass(frozen=True)
class Efficiency:
    """Fractions of the peaks that training reaches; one set for every model and layout (no per-model fits).

    ``gemm``: matrix multiplies (cuBLAS on large bf16 GEMMs). ``memory_passes``: how many times forward (backward:
    twice as many) reads or writes each activation byte of the Korthikanti et al. (2022) count at HBM speed: the
    elementwise work (norms, softmax, GELU, dropout, residuals) whose share grows as the hidden size per GPU shrinks.
    ``comm``: bus bandwidth reached by collectives. ``dp_overlap``: part of the data-parallel traffic hidden behind
    backward compute. ``latency_s``: fixed cost of one collective or send.

    Fixed costs that dominate small models on CPU, measured by ``plan --calibrate`` (0 on GPUs, where kernels
    queue behind each other and hide them), all for one process on a core of its own: ``layer_overhead_s``: the
    operator dispatch of one block's forward + backward for one microbatch (the embedding and the head count as one
    more block); ``tp_layer_overhead_s``: what tensor parallelism (DTensor dispatch, redistributions) adds to that;
    ``shard_collective_s``: what each FSDP2 all-gather or reduce-scatter adds to a collective's latency (hooks,
    copies in and out); ``step_overhead_s``: the optimizer step and the training loop, per step;
    ``sharded_step_overhead_s``: what the optimizer step adds when the parameters are DTensors (ZeRO-2/3, tp);
    ``microbatch_overhead_s``: what a pipeline schedule spends per microbatch and stage (sends, bookkeeping).
    """

    gemm: float = 0.70
    memory_passes: float = 2.0
    comm: float = 0.75
    dp_overlap: float = 0.7
    latency_s: float = 20e-6
    layer_overhead_s: float = 0.0
    tp_layer_overhead_s: float = 0.0
    shard_collective_s: float = 0.0
    step_overhead_s: float = 0.0
    sharded_step_overhead_s: float = 0.0
    microbatch_overhead_s: float = 0.0
    source: str = "defaults"


# name: (memory GB, dense bf16 TFLOP/s, NVLink GB/s per direction, network GB/s per GPU, HBM GB/s, GPUs per node,
# fp8 speed-up), from the one table of GPUs (`lightning_mgpu.gpus`)
PRESETS: dict[str, tuple[float, float, float, float, float, int, float]] = {
    gpu.preset: (
        gpu.memory_gb,
        gpu.bf16_tflops,
        gpu.nvlink_gbps,
        gpu.network_gbps,
        gpu.hbm_gbps,
        gpu.gpus_per_node,
        FP8_SPEEDUP if gpu.fp8 else 0.0,
    )
    for gpu in GPUS
}


def preset(name: str, gpus: int | None = None, **overrides: float) -> ClusterSpec:
    """A cluster of ``gpus`` (default: one node) of a known GPU; ``overrides`` replace single numbers."""
    key = name.lower()
    if key not in PRESETS:
        raise ValueError(
            f"Unknown --gpu {name!r}; known: {', '.join(PRESETS)}. Or give --gpu-memory-gb,"
            " --peak-tflops, --intra-node-gbps and --inter-node-gbps."
        )
    memory, tflops, intra, inter, hbm, per_node, fp8 = PRESETS[key]
    values = dict(
        memory_gb=memory,
        peak_tflops=tflops,
        intra_node_gbps=intra,
        inter_node_gbps=inter,
        hbm_gbps=hbm,
        gpus_per_node=per_node,
        fp8_speedup=fp8,
    )
    values.update({k: v for k, v in overrides.items() if v is not None})
    return ClusterSpec(gpus=gpus or int(values["gpus_per_node"]), name=key, **values)  # type: ignore[arg-type]
