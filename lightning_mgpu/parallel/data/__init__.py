"""Data parallelism and ZeRO stages 0-3 on torch's FSDP2 and composable DDP.

``check`` validates the options against a layout; ``apply`` wraps a module (or pipeline stage) for
its ZeRO stage, over all data-parallel ranks or hybrid-sharded (HSDP); ``OptimizerStateSharding`` is
ZeRO-1's optimizer-state partition; ``set_gradient_sync``, ``reduce_metrics_over`` and the unused-parameter
watch (``finish_backward``, ``stop_watching``) and ``prepare_backward`` (manual optimization's backward inside the
root's forward) serve the strategy's step; ``sharded_by_user`` tells a module the user's ``configure_model`` wrapped
with ``fully_shard`` itself (Lightning's ModelParallelStrategy style); ``use_gloo_comms`` gives FSDP2 gloo
collectives at their analytic volume. The questions of ``stages.py`` (``shards_parameters``, ...) say what a
ZeRO stage means to the rest of the run (what is partitioned or sharded, what stays whole): the one place that
interprets the stage number.
"""

from lightning_mgpu.parallel.data.buffers import once_per_step
from lightning_mgpu.parallel.data.checks import check
from lightning_mgpu.parallel.data.gloo_comms import use_gloo_comms
from lightning_mgpu.parallel.data.manual import prepare_backward
from lightning_mgpu.parallel.data.stages import (
    can_leave_gathered,
    frees_after_forward,
    partitions_optimizer_states,
    replicates_parameters,
    shards_parameters,
)
from lightning_mgpu.parallel.data.unused_params import finish_backward, stop_watching
from lightning_mgpu.parallel.data.wrap import (
    OptimizerStateSharding,
    apply,
    reduce_metrics_over,
    set_gradient_sync,
    sharded_by_user,
)

__all__ = [
    "OptimizerStateSharding",
    "apply",
    "can_leave_gathered",
    "check",
    "finish_backward",
    "frees_after_forward",
    "once_per_step",
    "partitions_optimizer_states",
    "prepare_backward",
    "reduce_metrics_over",
    "replicates_parameters",
    "set_gradient_sync",
    "sharded_by_user",
    "shards_parameters",
    "stop_watching",
    "use_gloo_comms",
]
