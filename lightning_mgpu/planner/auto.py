"""The planner asked from code: the best layout for a real module on the devices at hand, for ``"auto"`` sizes.

``choose_layout`` is what a strategy calls at setup, once it knows the module, the world size and the devices:
the sizes the user fixed are kept (``fixed``), the others are chosen, and the prediction is returned to be logged
beside the measured step time.
"""

from __future__ import annotations

import logging
import os
from typing import Optional

from torch import nn

from lightning_mgpu.planner.cluster import GB, PRESETS, ClusterSpec, Efficiency, preset
from lightning_mgpu.planner.cost import Estimate, Training
from lightning_mgpu.planner.model_spec import spec_from_module
from lightning_mgpu.planner.search import explain, search

log = logging.getLogger(__name__)


def local_cluster(world_size: int, devices_per_node: int, accelerator: str = "cpu") -> ClusterSpec:
    """This job's devices as a :class:`ClusterSpec`: a known GPU's preset with its real memory, or CPU processes
    sharing the machine's memory (rough rates: ``plan --calibrate`` measures them)."""
    if accelerator in ("cuda", "gpu"):
        import torch

        props = torch.cuda.get_device_properties(0)
        name = props.name.lower().replace(" ", "-")
        key = next((k for k in PRESETS if k.split("-")[0] in name), "h100-sxm")
        return preset(key, gpus=world_size, gpus_per_node=devices_per_node, memory_gb=props.total_memory / GB)
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GB
    except (ValueError, OSError):
        total = 16.0
    return ClusterSpec(gpus=world_size, gpus_per_node=devices_per_node, memory_gb=total / devices_per_node,
                       peak_tflops=0.02, intra_node_gbps=1.0, inter_node_gbps=0.1, hbm_gbps=10.0, reserved_gb=0.0,
                       name="cpu")


def choose_layout(module: nn.Module, cluster: ClusterSpec, global_batch: int, precision: str = "bf16-mixed",
                  fixed: Optional[dict[str, object]] = None, seq_len: Optional[int] = None,
                  efficiency: Optional[Efficiency] = None) -> Estimate:
    """The fastest layout that fits, keeping the ``fixed`` choices (``tp``, ``pp``, ``dp``, ``zero_stage``, ...).

    Raises ``ValueError`` naming what does not fit when no layout does.
    """
    spec = spec_from_module(module, seq_len=seq_len)
    plan = search(spec, cluster, Training(global_batch=global_batch, precision=precision), efficiency, fixed)
    if plan.best is None:
        raise ValueError(f"The planner found no layout for {spec.describe()} on {cluster.describe()}: "
                         + explain(plan))
    log.info("planner: %s", explain(plan))
    return plan.best
