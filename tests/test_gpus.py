"""The one table of GPUs: device names resolve to the right card, and the planner's presets are built from it."""

from __future__ import annotations

import pytest

from lightning_mgpu.gpus import BY_PRESET, GPUS, gpu_named
from lightning_mgpu.planner.cluster import PRESETS, preset


@pytest.mark.parametrize(
    ("device_name", "expected"),
    [
        ("NVIDIA H100 80GB HBM3", "h100-sxm"),
        ("NVIDIA H100 PCIe", "h100-pcie"),  # not the SXM card, though "H100" is in its name
        ("NVIDIA A100-SXM4-40GB", "a100-40gb"),
        ("NVIDIA A100-SXM4-80GB", "a100-80gb"),
        ("NVIDIA A10", "a10"),  # "A10" is also in every A100's name: the longest match wins
        ("NVIDIA L40S", "l40s"),
        ("NVIDIA L4", "l4"),
        ("NVIDIA H200", "h200"),
        ("AMD Instinct MI300X", "mi300x"),
        ("Intel(R) Data Center GPU Max 1550", None),
    ],
)
def test_device_names_resolve_to_their_card(device_name, expected):
    gpu = gpu_named(device_name)
    assert (gpu.preset if gpu else None) == expected


def test_the_planner_presets_are_the_table():
    assert list(PRESETS) == [gpu.preset for gpu in GPUS] and len(BY_PRESET) == len(GPUS)
    h100 = preset("h100-sxm")
    assert (h100.memory_gb, h100.peak_tflops, h100.intra_node_gbps) == (80, 989, 450)
    assert BY_PRESET["h100-sxm"].peak_flops(half=True, tf32=False) == 989e12
    assert BY_PRESET["h100-sxm"].peak_flops(half=False, tf32=False) == 67e12
