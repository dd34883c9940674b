"""The GPUs lightning-mgpu knows, from the vendors' data sheets: one table for the planner's presets and the
scaling monitor's peak FLOP/s.

Peaks are dense (no sparsity). ``nvlink_gbps`` is the bandwidth between GPUs of a node per direction (PCIe where
a card has no NVLink), ``network_gbps`` the network per GPU of a typical cluster of such cards; both are the
planner's defaults, which ``lightning-mgpu plan`` lets a user override.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class GPU:
    preset: str  # the planner's `--gpu` name
    device_name: str  # what `torch.cuda.get_device_name()` contains (the longest match wins)
    memory_gb: float
    bf16_tflops: float  # 16-bit tensor cores (bf16 and fp16 alike)
    tf32_tflops: float
    fp32_tflops: float
    nvlink_gbps: float
    network_gbps: float
    hbm_gbps: float
    gpus_per_node: int = 8
    fp8: bool = False  # fp8 tensor cores (Hopper, Ada, Blackwell, CDNA 3): twice the 16-bit dense peak

    def peak_flops(self, half: bool, tf32: bool) -> float:
        """Peak FLOP/s for 16-bit training (``half``), else fp32 with or without TF32 matmuls."""
        return 1e12 * (self.bf16_tflops if half else self.tf32_tflops if tf32 else self.fp32_tflops)


GPUS: tuple[GPU, ...] = (
    GPU("a100-40gb", "A100-SXM4-40GB", 40, 312, 156, 19.5, 300, 25, 1555),
    GPU("a100-80gb", "A100", 80, 312, 156, 19.5, 300, 25, 2039),
    GPU("h100-sxm", "H100", 80, 989, 494, 67, 450, 50, 3350, fp8=True),
    GPU("h100-pcie", "H100 PCIe", 80, 756, 378, 51, 64, 50, 2000, fp8=True),
    GPU("h200", "H200", 141, 989, 494, 67, 450, 50, 4800, fp8=True),
    GPU("b200", "B200", 180, 2250, 1100, 75, 900, 50, 8000, fp8=True),
    GPU("v100-32gb", "V100", 32, 125, 15.7, 15.7, 150, 12.5, 900),
    GPU("l40s", "L40S", 48, 362, 183, 91.6, 32, 25, 864, fp8=True),
    GPU("l4", "L4", 24, 121, 60, 30.3, 32, 25, 300, fp8=True),
    GPU("a10", "A10", 24, 125, 62.5, 31.2, 32, 25, 600),
    GPU("rtx-4090", "RTX 4090", 24, 165, 82.6, 82.6, 32, 25, 1008, fp8=True),
    GPU("t4", "T4", 16, 65, 8.1, 8.1, 16, 12.5, 320),
    GPU("mi300x", "MI300X", 192, 1307, 654, 163, 448, 50, 5300, fp8=True),
)
BY_PRESET = {gpu.preset: gpu for gpu in GPUS}


def gpu_named(device_name: str) -> GPU | None:
    """The GPU whose ``device_name`` is the longest found in ``device_name`` (``"NVIDIA H100 PCIe"``: h100-pcie,
    not h100-sxm), or None."""
    found = [gpu for gpu in GPUS if gpu.device_name.lower() in device_name.lower()]
    return max(found, key=lambda gpu: len(gpu.device_name), default=None)
