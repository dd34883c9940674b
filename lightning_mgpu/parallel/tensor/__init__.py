"""Tensor (+ sequence) parallelism over the layout's ``tp`` axis: plans, styles, per-head values and global-shape
regions, on DTensor.

``apply`` shards a module by a plan (``auto_plan`` derives one); ``check_options`` validates the
tensor-parallel options (a user's plan) before any process starts, ``check`` against one layout;
``tensor_parallel_context`` wraps a step. ``style`` and ``keep_grad_placement`` are what a plan is made of, for
code that writes one by hand (the benchmarks' torch baseline).
"""

from lightning_mgpu.parallel.tensor.checks import check_sharded_sizes
from lightning_mgpu.parallel.tensor.plan import auto_plan, check, check_options, check_style_names
from lightning_mgpu.parallel.tensor.sharding import apply, tensor_parallel_context
from lightning_mgpu.parallel.tensor.styles import keep_grad_placement, style

__all__ = [
    "apply",
    "auto_plan",
    "check",
    "check_options",
    "check_sharded_sizes",
    "check_style_names",
    "keep_grad_placement",
    "style",
    "tensor_parallel_context",
]
