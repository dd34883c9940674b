"""Expert parallelism: each rank of an ``ep`` group holds ``num_experts / ep`` experts of every MoE layer.

The ``ep`` axis is carved out of data parallelism (torchtitan's and Megatron's layout): the data-parallel ranks
``dp = replicas x ep`` are split into groups of ``ep`` consecutive ranks, each group holding every expert once. The
world stays ``pp x dp x tp``.

Hugging Face MoE layers (Mixtral, Qwen3-MoE, OLMoE, ... in transformers >= 5) call one experts module with fused
3-D weights (``gate_up_proj`` [E, 2I, H], ``down_proj`` [E, H, I]) as ``experts(hidden [T, H], top_k_index [T, k],
top_k_weights [T, k])``. The router is untouched (replicated: logits, top-k and the load-balancing loss as in one
process); its weights become DTensors sharded over ``ep`` on the expert dimension (checkpoints keep Hugging Face's
names and global shapes, and reshard to any ``ep``); the module keeps its own forward and runs it on this rank's
experts only (the DTensors' local shards, swapped in for the call), between two hooks:

- before: each (token, expert) pair is sent to the rank holding its expert (``all_to_all_single`` with autograd,
  so gradients flow back to the sending rank's hidden states), where the module sees the received tokens, their
  *local* expert index and a routing weight of 1;
- after: the expert outputs go back the same way, are multiplied by their routing weights and summed per token as
  the module itself would (the routing weights' gradient stays with the router on the sending rank).

A plain torch MoE (an ``nn.Linear`` router beside an ``nn.ModuleList`` of experts, gating code of the user's own)
keeps its forward too: each rank keeps its experts under their global indices, and the block's forward runs twice
with the same random state, expert calls recorded and then answered after one all-to-all each way (``_TwoPassCalls``).

Gradients: an expert's parameters see the tokens of all ``dp`` ranks' losses but live on ``dp / ep`` replicas, so
they are sharded with FSDP2 over the replicas (``fully_shard`` on the experts module, before the data-parallel wrap,
which then leaves them out) and divided by ``dp``, not by the replica count.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from lightning_mgpu._compat.dtensor import unflatten_mesh
from lightning_mgpu._compat.tensors import restore_parameters, set_children, swap_parameters
from lightning_mgpu.layout import DP_AXIS, EP_AXIS, EXPERT_REPLICA_AXIS, ParallelLayout
from lightning_mgpu.options import ParallelOptions, refuse_compositions

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup
    from torch.distributed.fsdp import MixedPrecisionPolicy, OffloadPolicy

_FUSED = ("gate_up_proj", "down_proj")
_TOTAL = "_lightning_mgpu_total_experts"


def find_experts(module: nn.Module) -> dict[str, nn.Module]:
    """``{fqn: experts module}``: modules with ``num_experts`` and fused 3-D weights of that many experts."""
    found = {}
    for name, sub in module.named_modules():
        # Once split, ``num_experts`` counts this rank's experts; the weights keep the global count.
        count = getattr(sub, _TOTAL, getattr(sub, "num_experts", None))
        params = [getattr(sub, leaf, None) for leaf in _FUSED]
        if (
            isinstance(count, int)
            and all(isinstance(p, nn.Parameter) and p.dim() == 3 and p.shape[0] == count for p in params)
            and _routed_call(sub)
        ):
            found[name] = sub
    return found


def expert_parameters(module: nn.Module) -> set[nn.Parameter]:
    """The parameters of experts split over ep (each rank holds its own, sharded over their own mesh)."""
    split = [m for m in find_experts(module).values() if hasattr(m, _TOTAL)]
    split += [m for m in module.modules() if isinstance(m, _LocalExperts)]
    return {p for m in split for p in m.parameters()}


def plan_without_experts(module: nn.Module, tp_plan: Any, sequence_parallel: bool, example: Any = None) -> Any:
    """A tensor-parallel plan (``"auto"`` or a dict) without entries for the experts: under ``ep`` they are split by
    expert over the data-parallel ranks, whole on every tensor-parallel rank (tensor parallelism of the rest)."""
    import fnmatch

    from lightning_mgpu.parallel.tensor import auto_plan

    if callable(tp_plan):
        return tp_plan
    plan = auto_plan(module, sequence_parallel, example) if tp_plan == "auto" else dict(tp_plan)
    containers = [
        *find_experts(module),
        *(_list_name(block, mod, experts) for block, (mod, experts) in find_expert_lists(module).items()),
    ]
    names = [n for n, _ in module.named_modules()] + [n for n, _ in module.named_parameters()]
    inside = [n for n in names if any(n == c or n.startswith(c + ".") for c in containers)]
    return {glob: style for glob, style in plan.items() if not any(fnmatch.fnmatchcase(n, glob) for n in inside)}


def _list_name(block_name: str, block: nn.Module, experts: nn.ModuleList) -> str:
    """The FQN of a torch MoE block's list of experts."""
    child = next(n for n, c in block.named_children() if c is experts)
    return f"{block_name}.{child}" if block_name else child


def _routed_call(experts: nn.Module) -> bool:
    """Whether the module is called with the routing, ``(hidden_states, top_k_index, top_k_weights)``: Llama-4's
    experts, called with tokens already gathered per expert, are not (their layer is not split over ep)."""
    import inspect

    return len(inspect.signature(experts.forward).parameters) >= 3


def check(layout: ParallelLayout, options: ParallelOptions) -> None:
    """When the Trainer is built: an ``ep`` that divides ``dp`` and compositions this version implements."""
    ep, dp = layout.expert_parallel_size, layout.data_parallel_size
    if ep == 1:
        return
    if dp % ep:
        valid = [d for d in range(1, dp + 1) if dp % d == 0]
        raise ValueError(
            f"expert_parallel_size={ep} must divide data_parallel_size={dp}: the ep groups are carved out of the"
            f" data-parallel ranks. Choose expert_parallel_size from {valid}, or give data parallelism more devices."
        )
    refuse_compositions(
        f"expert_parallel_size={ep}",
        {"sequence_parallel": options.sequence_parallel, "zero_backend='deepspeed'": options.zero_backend != "torch"},
        "sequence parallelism would hand each tensor-parallel rank part of the tokens its experts are routed; the"
        " DeepSpeed engine shards over every data-parallel rank, which hold different experts. Expert parallelism"
        " runs with data parallelism at ZeRO 0-3 (torch backend), tensor parallelism (without sequence_parallel) and"
        " pipeline parallelism; set sequence_parallel=False, zero_backend='torch', or expert_parallel_size=1.",
    )


def check_experts(module: nn.Module, ep: int) -> dict[str, nn.Module]:
    """Before training: the model has experts to shard, in counts ``ep`` divides."""
    experts: dict[str, Any] = {**find_experts(module), **{n: lst for n, (_, lst) in find_expert_lists(module).items()}}
    counts = {name: m.num_experts if hasattr(m, "num_experts") else len(m) for name, m in experts.items()}
    check_expert_counts(counts, ep, type(module).__name__)
    return experts


def check_expert_counts(counts: dict[str, int], ep: int, model_name: str) -> None:
    """Each mixture-of-experts layer's expert count (by name) divisible by ``ep``, and one layer at least (the
    planner checks a model's expert count with it, in the same words)."""
    if not counts:
        raise ValueError(
            f"expert_parallel_size={ep}, but {model_name} has no mixture-of-experts layer this version"
            " shards: a module with `num_experts` and fused 3-D `gate_up_proj`/`down_proj` weights (Hugging Face's"
            " Mixtral, Qwen3-MoE, OLMoE), or a block with an nn.ModuleList of experts and an nn.Linear router with one"
            " output per expert. Set expert_parallel_size=1 for this model."
        )
    uneven = {name: count for name, count in counts.items() if count % ep}
    if uneven:
        raise ValueError(
            f"expert_parallel_size={ep} must divide every layer's expert count, got {uneven}. Choose an"
            f" expert_parallel_size that divides {sorted(set(uneven.values()))}."
        )


def expert_mesh(mesh: DeviceMesh, ep: int) -> DeviceMesh:
    """The ``(dp_replicate, ep)`` sub-mesh of this rank: ``dp`` unflattened, ``ep`` consecutive ranks per group."""
    dp = mesh[DP_AXIS].size()
    full = unflatten_mesh(mesh, DP_AXIS, (dp // ep, ep), (EXPERT_REPLICA_AXIS, EP_AXIS))
    return full[EXPERT_REPLICA_AXIS, EP_AXIS]


def apply(
    module: nn.Module,
    mesh: DeviceMesh,
    ep: int,
    zero_stage: int,
    mp_policy: MixedPrecisionPolicy | None = None,
    offload_policy: OffloadPolicy | None = None,
    replicate: bool = False,
) -> DeviceMesh:
    """Keep this rank's experts in every MoE layer, route tokens to them, and wrap them over their replicas.

    ``replicate``: the experts are replicated over their replicas (FSDP2's ``replicate``) instead of sharded: the
    data-parallel wrap is a ``replicate`` whose gradient reduction a pipeline schedule drives (ZeRO 0/1 with
    pipelining), and it reduces only the states of its own kind.
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy, OffloadPolicy, fully_shard

    from lightning_mgpu._compat.fsdp import replicate_with_fsdp
    from lightning_mgpu.parallel.data import use_gloo_comms

    check_experts(module, ep)
    ep_mesh = expert_mesh(mesh, ep)
    dp = mesh[DP_AXIS].size()
    units: list[Any] = list(find_experts(module).values())  # FSDP-wrapped below: methods of the wrapped class
    for unit in units:
        _keep_local_experts(unit, ep_mesh[EP_AXIS])
    for block, experts in find_expert_lists(module).values():
        units += _split_expert_list(block, experts, ep_mesh[EP_AXIS])
    for experts_module in units:
        # FSDP2 over the replicas (ZeRO-3 for experts at every stage: they are a rank's own); the data-parallel
        # wrap that follows skips modules already wrapped. Their gradients come from all dp ranks' losses.
        policies: dict[str, Any] = dict(
            mp_policy=mp_policy or MixedPrecisionPolicy(), offload_policy=offload_policy or OffloadPolicy()
        )
        if replicate:
            replicate_with_fsdp(experts_module, mesh=ep_mesh[EXPERT_REPLICA_AXIS], **policies)
        else:
            fully_shard(
                experts_module,
                mesh=ep_mesh[EXPERT_REPLICA_AXIS],
                reshard_after_forward=zero_stage == 3,
                shard_placement_fn=_within_experts,
                **policies,
            )
            use_gloo_comms(experts_module)  # on gloo: an all-to-all reduce-scatter, a broadcast all-gather
        experts_module.set_gradient_divide_factor(float(dp))
        # A plain sum, then the division: gloo has no pre-multiplied sum (and the NCCL one is not zero-copy).
        experts_module.set_force_sum_reduction_for_comms(ep_mesh[EXPERT_REPLICA_AXIS].size() > 1)
    return ep_mesh


def _within_experts(param: nn.Parameter) -> Shard | None:
    """FSDP2 splits a weight's first dimension in chunks; a fused ``[experts, ...]`` weight would be split by whole
    experts, and with fewer experts per rank than replicas (Mixtral's 8 over ep 8: one each) the first replica would
    hold them all and the others none. Its second dimension splits evenly instead (a plain weight keeps the first)."""
    return Shard(1) if param.dim() == 3 else None


def _keep_local_experts(experts: Any, ep_mesh: DeviceMesh) -> None:  # a fused experts module (num_experts)
    ep, total = ep_mesh.size(), experts.num_experts
    local = total // ep
    for name, param in list(experts.named_parameters(recurse=False)):
        if param.dim() >= 1 and param.shape[0] == total:
            # A DTensor: checkpoints and optimizers see every expert under its own name and global shape.
            kept = distribute_tensor(param.detach(), ep_mesh, [Shard(0)])
            experts.register_parameter(name, nn.Parameter(kept, requires_grad=param.requires_grad))
    experts.num_experts = local
    setattr(experts, _TOTAL, total)
    routing = _Routing(ep_mesh.get_group(), ep, total)
    experts.register_forward_pre_hook(routing.dispatch)
    experts.register_forward_hook(routing.combine, always_call=True)


class _Routing:
    """One experts module's calls: tokens out to their experts' ranks before, results back after.

    A stack, not a slot: activation checkpointing re-enters the forward during backward.
    """

    def __init__(self, group: ProcessGroup, ep: int, total: int) -> None:
        self.group, self.ep, self.total = group, ep, total
        self.local = total // ep
        self.stack: list[tuple[dict[str, DTensor], torch.Tensor, torch.Tensor, list[int], list[int], int]] = []

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
            torch.arange(self.local, device=flat.device).repeat(self.ep), recv_counts.reshape(-1)
        )
        # The module's own forward runs on this rank's experts: the local shards of its DTensor parameters.
        # Differentiable views: the gradient reaches the DTensor.
        local = {name: p.to_local() for name, p in module.named_parameters(recurse=False) if isinstance(p, DTensor)}
        originals = swap_parameters(module, local)
        self.stack.append((originals, tokens, weights.reshape(-1)[order], send, recv, hidden.shape[0]))
        ones = torch.ones(local_index.shape[0], 1, dtype=weights.dtype, device=weights.device)
        return (inputs, local_index[:, None], ones, *args[3:])

    def combine(self, module: nn.Module, args: tuple, output: object) -> Any:
        if not self.stack:
            return output
        originals, tokens, weights, send, recv, num_tokens = self.stack.pop()
        restore_parameters(module, originals)
        if not torch.is_tensor(output):
            return output  # None when the forward raised (this hook always runs)
        back = _all_to_all(output, send, recv, self.group)
        weighted = back * weights[:, None]
        combined = torch.zeros(num_tokens, *output.shape[1:], dtype=output.dtype, device=output.device)
        return combined.index_add(0, tokens, weighted.to(output.dtype))


def _all_to_all(
    tensor: torch.Tensor, output_splits: list[int], input_splits: list[int], group: ProcessGroup
) -> torch.Tensor:
    """``all_to_all_single`` with autograd (the backward sends gradients the reverse way)."""
    from torch.distributed.nn.functional import all_to_all_single

    out = tensor.new_empty(sum(output_splits), *tensor.shape[1:])
    return all_to_all_single(out, tensor.contiguous(), output_splits, input_splits, group=group)


# ------------------------------------------------------------------------ a user's MoE: router + list of experts
def find_expert_lists(module: nn.Module) -> dict[str, tuple[nn.Module, nn.ModuleList]]:
    """``{fqn: (block, experts)}``: blocks with an ``nn.ModuleList`` of 2+ experts of one type and an ``nn.Linear``
    router child with one output per expert (a plain torch MoE as users write it)."""
    found = {}
    for name, block in module.named_modules():
        lists = [
            c
            for c in block.children()
            if isinstance(c, nn.ModuleList)
            and len(c) > 1
            and len({type(e) for e in c}) == 1
            and any(True for _ in c.parameters())
        ]
        routers = {c.out_features for c in block.children() if isinstance(c, nn.Linear)}
        for experts in lists:
            if len(experts) in routers:
                found[name] = (block, experts)
    return found


def _router_input_size(block: nn.Module, count: int) -> int:
    return next(c.in_features for c in block.children() if isinstance(c, nn.Linear) and c.out_features == count)


def _split_expert_list(block: nn.Module, experts: nn.ModuleList, ep_mesh: DeviceMesh) -> list[nn.Module]:
    """Keep this rank's experts under their own indices (plain FQNs ``experts.<i>.…``); route the block's calls."""
    from lightning_mgpu.parallel.activation import is_checkpointed

    if is_checkpointed(block):
        raise NotImplementedError(
            f"expert_parallel_size={ep_mesh.size()} with activation checkpointing of {type(block).__name__}, an MoE"
            " block whose experts are an nn.ModuleList: its recomputation in backward would call the experts without"
            " their routing. Set activation_checkpointing=False (or checkpoint other modules by class)."
        )
    ep, rank = ep_mesh.size(), ep_mesh.get_local_rank()
    total = len(experts)
    local = total // ep
    mine = {str(i): experts[i] for i in range(rank * local, (rank + 1) * local)}
    weight = next(experts.parameters())
    empty = torch.zeros(0, _router_input_size(block, total), dtype=weight.dtype, device=weight.device)
    with torch.no_grad():  # the output's trailing shape, for the first pass's placeholders
        sample = next(iter(mine.values()))(empty)
    set_children(experts, mine)
    experts.__class__ = _LocalExperts
    calls = _TwoPassCalls(experts, mine, ep_mesh.get_group(), ep, total, tuple(sample.shape[1:]), empty)
    experts._lightning_mgpu_calls = calls  # type: ignore[assignment]  # for expert_counts.ExpertTokenCounts
    block.register_forward_pre_hook(calls.record, with_kwargs=True)
    block.register_forward_hook(calls.replay, with_kwargs=True, always_call=True)
    return list(mine.values())


class _LocalExperts(nn.ModuleList):
    """A rank's experts, under their global indices (``experts.2``, ``experts.3``), indexed by position."""

    def __getitem__(self, idx: Any) -> Any:
        if isinstance(idx, slice):
            return nn.ModuleList(list(self.children())[idx])
        return list(self.children())[idx]


class _ExpertCall(nn.Module):
    """Stands in for expert ``index`` during the block's forward: every call goes through ``_TwoPassCalls``."""

    def __init__(self, index: int, calls: _TwoPassCalls) -> None:
        super().__init__()
        self.index = index
        self._calls = [calls]  # a list: not a submodule

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._calls[0].call(self.index, x)


class _TwoPassCalls:
    """The block's own forward, run twice with the same random state. First pass: each expert call is recorded and
    answered with zeros. Then one all-to-all takes every recorded input to its expert's rank, the experts run once
    each, one all-to-all brings the outputs back. Second pass: each call is answered with its output. The gating
    code, whatever it is (top-k, capacity, skipped empty experts), runs unchanged and each rank may call its
    experts in any order: no collective depends on it."""

    def __init__(
        self,
        experts: nn.ModuleList,
        mine: dict[str, nn.Module],
        group: ProcessGroup,
        ep: int,
        total: int,
        out_shape: tuple[int, ...],
        empty: torch.Tensor,
    ) -> None:
        self.empty = empty  # what this rank sends when it called no expert
        self.experts, self.mine, self.group = experts, mine, group
        self.ep, self.total, self.local, self.out_shape = ep, total, total // ep, out_shape
        self.proxies = {str(i): _ExpertCall(i, self) for i in range(total)}
        self.recorded: list[tuple[int, torch.Tensor]] = []
        self.answers: dict[int, list[torch.Tensor]] | None = None
        self.rng: Any = None

    def call(self, index: int, x: torch.Tensor) -> torch.Tensor:
        if self.answers is None:
            self.recorded.append((index, x))
            return x.new_zeros(x.shape[0], *self.out_shape)
        answer = self.answers[index].pop(0)
        if answer.shape[0] != x.shape[0]:
            raise RuntimeError(
                f"expert {index} was called with {x.shape[0]} tokens, but with {answer.shape[0]} in the same forward"
                " a moment before: expert parallelism runs the MoE block's forward twice and needs it deterministic"
                " (random ops are replayed with the same seed; other state must not change between calls)."
            )
        return answer

    def record(self, block: nn.Module, args: tuple, kwargs: dict) -> None:
        self.recorded, self.answers = [], None
        self.rng = _rng_state()
        set_children(self.experts, self.proxies)

    def replay(self, block: nn.Module, args: tuple, kwargs: dict, output: object) -> Any:
        if self.answers is not None or output is None:  # the second pass, or the first one raised
            self._restore()
            return output
        try:
            self.answers = self._exchange()
            _set_rng_state(self.rng)
            return block.forward(*args, **kwargs)
        finally:
            self._restore()

    def _restore(self) -> None:
        set_children(self.experts, self.mine)
        self.recorded, self.answers = [], None

    def _exchange(self) -> dict[int, list[torch.Tensor]]:
        """Recorded inputs to their experts' ranks and back (two autograd all-to-alls), split per call."""
        recorded = self.recorded
        order = sorted(range(len(recorded)), key=lambda j: recorded[j][0])  # by expert, then call order
        sizes = [recorded[j][1].shape[0] for j in order]
        counts = torch.zeros(self.total, dtype=torch.long, device=self.empty.device)
        for j in order:
            counts[recorded[j][0]] += recorded[j][1].shape[0]
        inputs = torch.cat([recorded[j][1] for j in order]) if recorded else self.empty
        received = torch.empty_like(counts)
        dist.all_to_all_single(received, counts, group=self.group)
        send = counts.view(self.ep, self.local).sum(1).tolist()
        per_source = received.view(self.ep, self.local)
        tokens = _all_to_all(inputs, per_source.sum(1).tolist(), send, self.group)
        outputs = self._run_local(tokens, per_source)
        back = _all_to_all(outputs, send, per_source.sum(1).tolist(), self.group)
        answers: dict[int, list[torch.Tensor]] = {i: [] for i in range(self.total)}
        for j, piece in zip(order, back.split(sizes)):
            answers[recorded[j][0]].append(piece)
        return answers

    def _run_local(self, tokens: torch.Tensor, per_source: torch.Tensor) -> torch.Tensor:
        """Each local expert once, on its tokens from every source; outputs in the received order."""
        pieces = tokens.split(per_source.reshape(-1).tolist())  # [source][local expert]
        outs: list[torch.Tensor | None] = [None] * len(pieces)
        for e, expert in enumerate(self.mine.values()):
            mine = [s * self.local + e for s in range(self.ep)]
            result = expert(torch.cat([pieces[k] for k in mine]))
            for k, part in zip(mine, result.split([pieces[k].shape[0] for k in mine])):
                outs[k] = part
        return torch.cat(outs)  # type: ignore[arg-type]


def _rng_state() -> tuple[torch.Tensor, list[torch.Tensor] | None]:
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
    return torch.get_rng_state(), cuda


def _set_rng_state(state: tuple[torch.Tensor, list[torch.Tensor] | None]) -> None:
    torch.set_rng_state(state[0])
    if state[1] is not None:
        torch.cuda.set_rng_state_all(state[1])


def with_peers_listed_experts(module: nn.Module, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A full model ``state`` completed with the torch-MoE experts the other ranks of each ep group hold (each
    rank holds its own under their plain FQNs): what every rank needs to put the whole plain module back. Collective
    over the ep groups."""
    for name, local in module.named_modules():
        calls = getattr(local, "_lightning_mgpu_calls", None)
        if not isinstance(local, _LocalExperts) or calls is None:
            continue
        mine = {key: value.detach().cpu() for key, value in state.items() if key.startswith(f"{name}.")}
        device = next(iter(state.values())).device
        gathered: list[Any] = [None] * calls.ep
        dist.all_gather_object(gathered, mine, group=calls.group)
        for part in gathered:
            state.update({key: value.to(device) for key, value in part.items() if key not in state})
    return state
