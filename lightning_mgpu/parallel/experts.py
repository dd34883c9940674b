"""Expert parallelism: each rank of an ``ep`` group holds ``num_experts / ep`` experts of every MoE layer.

The ``ep`` axis is carved out of data parallelism (torchtitan's and Megatron's layout): the data-parallel ranks
``dp = replicas x ep`` are split into groups of ``ep`` consecutive ranks, each group holding every expert once. The
world stays ``pp x dp x tp``.

Hugging Face MoE layers (Mixtral, Qwen3-MoE, OLMoE, ... in transformers >= 5) call one experts module with fused
3-D weights (``gate_up_proj`` [E, 2I, H], ``down_proj`` [E, H, I]) as ``experts(hidden [T, H], top_k_index [T, k],
top_k_weights [T, k])``. The router is untouched (replicated: logits, top-k and the load-balancing loss as in one
process); the experts module keeps its own forward and runs it on this rank's experts only, between two hooks:

- before: each (token, expert) pair is sent to the rank holding its expert (``all_to_all_single`` with autograd,
  so gradients flow back to the sending rank's hidden states), where the module sees the received tokens, their
  *local* expert index and a routing weight of 1;
- after: the expert outputs go back the same way, are multiplied by their routing weights and summed per token as
  the module itself would (the routing weights' gradient stays with the router on the sending rank).

Gradients: an expert's parameters see the tokens of all ``dp`` ranks' losses but live on ``dp / ep`` replicas, so
they are sharded with FSDP2 over the replicas (``fully_shard`` on the experts module, before the data-parallel wrap,
which then leaves them out) and divided by ``dp``, not by the replica count.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

EP_AXIS = "ep"
REPLICA_AXIS = "dp_replicate"  # the data-parallel ranks that hold the same experts
_FUSED = ("gate_up_proj", "down_proj")


def find_experts(module: nn.Module) -> dict[str, nn.Module]:
    """``{fqn: experts module}``: modules with ``num_experts`` and fused 3-D weights of that many experts."""
    found = {}
    for name, sub in module.named_modules():
        count = getattr(sub, "num_experts", None)
        params = [getattr(sub, leaf, None) for leaf in _FUSED]
        if isinstance(count, int) and all(isinstance(p, nn.Parameter) and p.dim() == 3 and p.shape[0] == count
                                          for p in params):
            found[name] = sub
    return found


def check_expert_layout(options: Any, layout: Any) -> None:
    """When the Trainer is built: an ``ep`` that divides ``dp`` and compositions this version implements."""
    ep, dp = options.expert_parallel_size, layout.data_parallel_size
    if dp % ep:
        valid = [d for d in range(1, dp + 1) if dp % d == 0]
        raise ValueError(
            f"expert_parallel_size={ep} must divide data_parallel_size={dp}: the ep groups are carved out of the"
            f" data-parallel ranks. Choose expert_parallel_size from {valid}, or give data parallelism more devices."
        )
    unsupported = {
        "tensor_parallel_size": layout.tensor_parallel_size > 1,
        "pipeline_parallel_size": layout.pipeline_parallel_size > 1,
        "zero_stage=1": layout.zero_stage == 1,
        "zero_backend='deepspeed'": options.zero_backend != "torch",
    }
    named = [name for name, bad in unsupported.items() if bad]
    if named:
        raise NotImplementedError(
            f"expert_parallel_size={ep} does not compose with {', '.join(named)} yet (ZeRO-1's broadcast of updated"
            " parameters would run over data-parallel ranks that hold different experts). Expert parallelism runs"
            " with data parallelism at zero_stage 0, 2 or 3 (torch backend); set expert_parallel_size=1 otherwise."
        )


def check_experts(module: nn.Module, ep: int) -> dict[str, nn.Module]:
    """Before training: the model has experts to shard, in counts ``ep`` divides."""
    experts = find_experts(module)
    if not experts:
        raise ValueError(
            f"expert_parallel_size={ep}, but {type(module).__name__} has no mixture-of-experts layer this version"
            " shards (a module with `num_experts` and fused 3-D `gate_up_proj`/`down_proj` weights, as Hugging Face's"
            " Mixtral, Qwen3-MoE and OLMoE have). Set expert_parallel_size=1 for this model."
        )
    uneven = {name: m.num_experts for name, m in experts.items() if m.num_experts % ep}
    if uneven:
        raise ValueError(
            f"expert_parallel_size={ep} must divide every layer's expert count, got {uneven}. Choose an"
            f" expert_parallel_size that divides {sorted(set(uneven.values()))}."
        )
    return experts


def expert_mesh(mesh: DeviceMesh, ep: int) -> DeviceMesh:
    """The ``(dp_replicate, ep)`` sub-mesh of this rank: ``dp`` unflattened, ``ep`` consecutive ranks per group."""
    dp = mesh["dp"].size()
    full = mesh._unflatten("dp", (dp // ep, ep), (REPLICA_AXIS, EP_AXIS))
    return full[REPLICA_AXIS, EP_AXIS]


def apply_expert_parallel(module: nn.Module, mesh: DeviceMesh, ep: int, zero_stage: int,
                          mp_policy: Optional[Any] = None, offload_policy: Optional[Any] = None) -> DeviceMesh:
    """Keep this rank's experts in every MoE layer, route tokens to them, and wrap them over their replicas."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, OffloadPolicy, fully_shard

    experts = check_experts(module, ep)
    ep_mesh = expert_mesh(mesh, ep)
    dp = mesh["dp"].size()
    for experts_module in experts.values():
        _keep_local_experts(experts_module, ep_mesh[EP_AXIS])
        # FSDP2 over the replicas (ZeRO-3 for experts at every stage: they are a rank's own); the data-parallel
        # wrap that follows skips modules already wrapped. Their gradients come from all dp ranks' losses.
        fully_shard(experts_module, mesh=ep_mesh[REPLICA_AXIS], reshard_after_forward=zero_stage == 3,
                    mp_policy=mp_policy or MixedPrecisionPolicy(), offload_policy=offload_policy or OffloadPolicy())
        experts_module.set_gradient_divide_factor(float(dp))
    return ep_mesh


def _keep_local_experts(experts: nn.Module, ep_mesh: DeviceMesh) -> None:
    ep, rank = ep_mesh.size(), ep_mesh.get_local_rank()
    total = experts.num_experts
    local = total // ep
    for name, param in list(experts.named_parameters(recurse=False)):
        if param.dim() >= 1 and param.shape[0] == total:
            kept = param.detach()[rank * local:(rank + 1) * local].clone()
            experts.register_parameter(name, nn.Parameter(kept, requires_grad=param.requires_grad))
    experts.num_experts = local
    routing = _Routing(ep_mesh.get_group(), ep, total)
    experts.register_forward_pre_hook(routing.dispatch)
    experts.register_forward_hook(routing.combine, always_call=True)


class _Routing:
    """One experts module's calls: tokens out to their experts' ranks before, results back after.

    A stack, not a slot: activation checkpointing re-enters the forward during backward.
    """

    def __init__(self, group: Any, ep: int, total: int) -> None:
        self.group, self.ep, self.total = group, ep, total
        self.local = total // ep
        self.stack: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[int], list[int], int]] = []

    def dispatch(self, module: nn.Module, args: tuple) -> tuple:
        hidden, index, weights = args[:3]
        k = index.shape[-1]
        flat = index.reshape(-1)
        order = torch.argsort(flat, stable=True)
        tokens = order // k  # the token of each sorted (token, expert) pair
        counts = torch.bincount(flat, minlength=self.total)
        received = torch.empty_like(counts)
        dist.all_to_all_single(received, counts, group=self.group)  # [source, local expert] counts
        send = counts.view(self.ep, self.local).sum(1).tolist()
        recv_counts = received.view(self.ep, self.local)
        recv = recv_counts.sum(1).tolist()
        inputs = _all_to_all(hidden[tokens], recv, send, self.group)
        local_index = torch.repeat_interleave(
            torch.arange(self.local, device=flat.device).repeat(self.ep), recv_counts.reshape(-1))
        self.stack.append((tokens, weights.reshape(-1)[order], hidden, send, recv, hidden.shape[0]))
        ones = torch.ones(local_index.shape[0], 1, dtype=weights.dtype, device=weights.device)
        return (inputs, local_index[:, None], ones, *args[3:])

    def combine(self, module: nn.Module, args: tuple, output: Any) -> Any:
        if not self.stack:
            return output
        tokens, weights, hidden, send, recv, num_tokens = self.stack.pop()
        if not torch.is_tensor(output):
            return output  # None when the forward raised (this hook always runs)
        back = _all_to_all(output, send, recv, self.group)
        weighted = back * weights[:, None]
        combined = torch.zeros(num_tokens, *output.shape[1:], dtype=output.dtype, device=output.device)
        return combined.index_add(0, tokens, weighted.to(output.dtype))


def _all_to_all(tensor: torch.Tensor, output_splits: list[int], input_splits: list[int], group: Any) -> torch.Tensor:
    """``all_to_all_single`` with autograd (the backward sends gradients the reverse way)."""
    from torch.distributed.nn.functional import all_to_all_single

    out = tensor.new_empty(sum(output_splits), *tensor.shape[1:])
    return all_to_all_single(out, tensor.contiguous(), output_splits, input_splits, group=group)
