"""The planner: predict memory per GPU and step time of a layout, rank layouts, and explain the choice.

``model_spec`` describes the model (from flags or a real module on the meta device), ``cluster`` the machines and
the achieved fractions of their peaks, ``job`` the training setup and the planned layout (the strategy's
``ParallelLayout`` and ``ParallelOptions`` with the planner's own microbatching), ``cost`` the memory and
time model, ``search`` the enumeration and ranking, ``calibrate`` the ``--calibrate`` measurements, ``auto`` the
entry point for ``"auto"`` sizes (``choose_layout``). The ``lightning-mgpu plan`` command line is
``lightning_mgpu.cli.plan``.

A lower layer: the strategy calls it when the Trainer is built (``auto``), so nothing here imports
``lightning_mgpu.strategy``. The ``--rehearse`` runs, which drive the strategy's setup path, are
``lightning_mgpu.rehearsal``, above the strategy beside the command line.
"""

from lightning_mgpu.planner.auto import choose_layout, local_cluster
from lightning_mgpu.planner.cluster import PRESETS, ClusterSpec, Efficiency, preset
from lightning_mgpu.planner.cost import Estimate, estimate, paper_flops_per_step
from lightning_mgpu.planner.job import Layout, Microbatching, Training, microbatching_for
from lightning_mgpu.planner.model_spec import ModelSpec, build_on_meta, spec_from_module, spec_from_path
from lightning_mgpu.planner.search import Plan, explain, parse_fix, search

__all__ = [
    "PRESETS",
    "ClusterSpec",
    "Efficiency",
    "Estimate",
    "Layout",
    "Microbatching",
    "ModelSpec",
    "Plan",
    "Training",
    "build_on_meta",
    "choose_layout",
    "estimate",
    "explain",
    "local_cluster",
    "microbatching_for",
    "paper_flops_per_step",
    "parse_fix",
    "preset",
    "search",
    "spec_from_module",
    "spec_from_path",
]
