"""Expert parallelism for mixture-of-experts models: experts split over an ``ep`` group carved out of data
parallelism, the router's load-balancing loss over the whole batch, and tokens counted per expert.

``check`` validates a layout before processes start; ``plan_without_experts`` and ``apply``
are the steps ``parallelize`` takes; ``with_peers_listed_experts`` completes a gathered state at teardown.
"""

from lightning_mgpu.parallel.experts.counts import ExpertTokenCounts
from lightning_mgpu.parallel.experts.router_loss import apply_global_router_loss, check_no_router_loss
from lightning_mgpu.parallel.experts.sharding import (
    apply,
    check,
    check_expert_counts,
    expert_parameters,
    find_expert_lists,
    find_experts,
    plan_without_experts,
    with_peers_listed_experts,
)

__all__ = [
    "ExpertTokenCounts",
    "apply",
    "apply_global_router_loss",
    "check",
    "check_expert_counts",
    "check_no_router_loss",
    "expert_parameters",
    "find_expert_lists",
    "find_experts",
    "plan_without_experts",
    "with_peers_listed_experts",
]
