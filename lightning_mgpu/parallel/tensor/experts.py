"""Mixture-of-experts tensor parallelism: every rank holds a slice of every expert's intermediate features.

Hugging Face (transformers >= 5) keeps a layer's experts in one module with fused 3-D parameters (Mixtral and
Qwen3-MoE: ``gate_up_proj`` [E, 2*I, H], ``down_proj`` [E, H, I]) and runs them with kernels that index experts
(an eager loop, ``grouped_mm``, ``batched_mm``) and are not DTensor-aware. Its plan shards the *parameters* by name
(``packed_colwise``: the packed [gate | up] output dimension, each rank its halves of both; ``rowwise``: the
intermediate input dimension) and gives the *module* ``moe_tp_experts``: the kernels run on the local shards and
the ranks' partial outputs are summed. Served here with torch's DTensor:

- each parameter is a DTensor (``Shard``/``_StridedShard`` on the plan's dimension), so checkpoints, optimizers and
  data-parallel sharding see the global expert tensors under their own names;
- the module's forward runs on their local views (swapped in for the call, always swapped back);
- its floating-point inputs (hidden states, routing weights) enter replicated and leave with partial gradients
  (summed over the ranks in backward), as a column-parallel layer's input does;
- its output is a partial sum, redistributed to the input's layout as a row-parallel layer's output is: an
  all-reduce, or a reduce-scatter when the input was sequence-sharded.

The router is not touched: replicated, it computes its logits, top-k and load-balancing loss as one process does.
"""

from __future__ import annotations

import fnmatch
import math
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle
from typing_extensions import override

from lightning_mgpu._compat.dtensor import StyleHooks, strided_chunks, strided_shard
from lightning_mgpu._compat.tensors import restore_parameters, swap_parameters

# Styles a plan may give a parameter of a 'moe_tp_experts' module (Hugging Face's meaning on parameters).
PARAMETER_STYLES = ("colwise", "rowwise", "packed_colwise", "packed_rowwise")
EXPERTS_STYLE = "moe_tp_experts"
_PACKED = 2  # [gate | up]: two chunks along the packed dimension


def owned_by_experts(glob: str, plan: dict[str, str]) -> bool:
    """Whether ``glob`` names a parameter of a module that the plan runs on local expert shards."""
    owner = glob.rpartition(".")[0]
    return plan.get(glob) in PARAMETER_STYLES and plan.get(owner) == EXPERTS_STYLE


def names_parameters_only(module: nn.Module, glob: str) -> bool:
    """Whether ``glob`` matches parameters; asked of entries that match no module, i.e. that name parameters only
    (placed by their module's experts style, not matched as modules)."""
    names = [name for name, _ in module.named_parameters()]
    return any(fnmatch.fnmatchcase(n, glob) for n in names)


def parameter_placement(style_name: str, name: str, param: torch.Tensor) -> Placement:
    """Hugging Face's meaning of a parameter style, as a DTensor placement of that parameter.

    A weight [..., out, in]: ``colwise`` shards ``out`` (dim -2), ``rowwise`` shards ``in`` (dim -1); ``packed_*``
    the same dimensions holding two packed chunks (each rank its part of each). A bias [..., out] shards its last
    dimension; a row-parallel bias, added once after the sum, has no per-rank share and is refused.
    """
    last = param.dim() - 1
    is_bias = name.endswith("bias") or param.dim() == 1
    if style_name in ("rowwise", "packed_rowwise") and is_bias:
        raise ValueError(
            f"{name}: a row-parallel bias of experts would be added by every rank, then summed over the ranks."
            " Keep this experts module whole: give it (and its parameters) 'replicate' in `tp_plan`."
        )
    dim = last if is_bias or style_name in ("rowwise", "packed_rowwise") else last - 1
    return strided_shard(dim, _PACKED) if style_name.startswith("packed") else Shard(dim)


def expert_placements(module: nn.Module, plan: dict[str, str], matched: dict[str, str]) -> dict[str, dict]:
    """``{experts module: {parameter: placement}}`` from the plan's parameter entries; every parameter entry must
    belong to a 'moe_tp_experts' module, and every parameter of such a module must be placed."""
    parameter_globs = {
        g: s
        for g, s in plan.items()
        if s in PARAMETER_STYLES
        and names_parameters_only(module, g)
        and not any(fnmatch.fnmatchcase(n, g) for n, _ in module.named_modules())
    }
    placements: dict[str, dict[str, Placement]] = {fqn: {} for fqn, s in matched.items() if s == EXPERTS_STYLE}
    for name, param in module.named_parameters():
        owner, _, leaf = name.rpartition(".")
        for glob, style_name in parameter_globs.items():
            if not fnmatch.fnmatchcase(name, glob):
                continue
            if owner not in placements:
                raise ValueError(
                    f"`tp_plan` gives parameter {name!r} the style {style_name!r}, but its module {owner!r} is not"
                    f" '{EXPERTS_STYLE}' (parameter styles place the weights of an experts module). Add"
                    f" {{{glob.rpartition('.')[0]!r}: '{EXPERTS_STYLE}'}} or shard the module with a module style."
                )
            placements[owner][leaf] = parameter_placement(style_name, name, param)
    for owner, placed in placements.items():
        missing = [n for n, _ in module.get_submodule(owner).named_parameters() if n not in placed]
        if missing:
            raise ValueError(
                f"{owner} runs on local expert shards ('{EXPERTS_STYLE}'), but `tp_plan` places none of its parameters"
                f" {missing}: a whole copy on every rank would be summed once per rank. Give each a parameter style"
                f" from {list(PARAMETER_STYLES)}, e.g. {{'{owner}.{missing[0]}': 'packed_colwise'}}."
            )
    return placements


def check_expert_sizes(module: nn.Module, placements: dict[str, dict[str, Placement]], tp: int) -> None:
    """Before training: each sharded expert dimension divisible by the degree (twice over for a packed one)."""
    problems, sizes = [], []
    placement: Any  # a Shard or a _StridedShard (not a Shard subclass in torch 2.13): both have `dim`
    for owner, placed in placements.items():
        for leaf, placement in placed.items():
            param = module.get_submodule(owner).get_parameter(leaf)
            chunks = strided_chunks(placement)
            size = param.shape[placement.dim] // chunks
            sizes.append(size)
            if param.shape[placement.dim] % (chunks * tp):
                per = f" in each of its {chunks} packed chunks" if chunks > 1 else ""
                problems.append(f"{owner}.{leaf}: {size} features{per} on dimension {placement.dim}")
    if problems:
        common = math.gcd(*sizes)
        valid = [d for d in range(2, common + 1) if common % d == 0]
        raise ValueError(
            f"tensor_parallel_size={tp} must divide every sharded expert size, but: {'; '.join(problems)}."
            f" Valid tensor_parallel_size values for these experts: {valid or 'none above 1'}."
        )


def place_experts(
    module: nn.Module,
    plan: dict[str, str],
    matched: dict[str, str],
    styles: dict[str, Any],
    tp: int,
    sequence_parallel: bool = False,
) -> None:
    """Give each 'moe_tp_experts' style the placements of its module's parameters, checked before sharding."""
    placements = expert_placements(module, plan, matched)
    check_expert_sizes(module, placements, tp)
    if placements and sequence_parallel:
        _check_router_logits_stay_inside(module)
    for fqn, placed in placements.items():
        styles[fqn].placements = placed


def _check_router_logits_stay_inside(module: nn.Module) -> None:
    """Under sequence parallelism the router's logits are sequence-sharded DTensors: returned to Hugging Face's
    load-balancing loss they meet its plain language-model loss in an in-place add, which DTensor refuses mid-step."""
    returning = next(
        (
            f"{name or 'the module'} ({type(m).__name__})"
            for name, m in module.named_modules()
            if hasattr(m, "base_model_prefix")
            and getattr(getattr(m, "config", None), "output_router_logits", False) is True
        ),
        None,
    )
    if returning:
        raise ValueError(
            f"sequence_parallel=True with a mixture-of-experts model that returns its router logits, {returning}"
            " (config.output_router_logits=True, for the load-balancing loss): those logits are sharded over the"
            " sequence and Hugging Face's loss cannot add them to its plain loss. Set"
            " config.output_router_logits=False, or train this model with sequence_parallel=False."
        )


class ExpertsParallel(StyleHooks, ParallelStyle):
    """'moe_tp_experts': the module's parameters sharded by ``placements``, its forward run on their local shards
    between a replicated input (partial gradients) and a partial output (see the module docstring)."""

    def __init__(self, placements: dict[str, Placement] | None = None) -> None:
        super().__init__()
        self.placements = dict(placements or {})

    @override
    def apply_style(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        for name, placement in self.placements.items():
            owner, _, leaf = name.rpartition(".")
            holder = module.get_submodule(owner)
            param = holder.get_parameter(leaf)
            if isinstance(param, DTensor):
                continue
            sharded = distribute_tensor(param.detach(), device_mesh, [placement], src_data_rank=self.src_data_rank)
            holder.register_parameter(leaf, nn.Parameter(sharded, requires_grad=param.requires_grad))
        call = _LocalShardsCall(device_mesh)
        module.register_forward_pre_hook(call.enter, with_kwargs=True)
        module.register_forward_hook(call.leave, always_call=True)
        return module


class IdentityExpertParallel(StyleHooks, ParallelStyle):
    """'moe_identity_expert': an expert that returns its input (LongCat-Flash's zero experts) inside a
    'moe_tp_experts' module, whose output the ranks sum: each rank contributes ``1/tp`` of it."""

    @override
    def apply_style(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        tp = device_mesh.size()

        def divide(mod: nn.Module, args: tuple) -> tuple:
            return tuple(a / tp if torch.is_tensor(a) and torch.is_floating_point(a) else a for a in args)

        module.register_forward_pre_hook(divide)
        return module


class _LocalShardsCall:
    """One experts module's calls: DTensor parameters swapped for their local shards, inputs and output converted.

    A stack, not a slot: activation checkpointing re-enters the forward during backward.
    """

    def __init__(self, mesh: DeviceMesh) -> None:
        self.mesh = mesh
        self.stack: list[tuple[dict[str, DTensor], tuple | None]] = []

    def enter(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        first = next((a for a in (*args, *kwargs.values()) if torch.is_tensor(a)), None)
        layout = tuple(first.placements) if isinstance(first, DTensor) else None
        args = tuple(self._replicated(a) for a in args)
        kwargs = {k: self._replicated(v) for k, v in kwargs.items()}
        # Differentiable views: the gradient reaches the DTensor.
        local = {name: p.to_local() for name, p in module.named_parameters(recurse=False) if isinstance(p, DTensor)}
        self.stack.append((swap_parameters(module, local), layout))
        return args, kwargs

    def leave(self, module: nn.Module, args: tuple, output: object) -> Any:
        if not self.stack:
            return output
        originals, layout = self.stack.pop()
        restore_parameters(module, originals)
        if not torch.is_tensor(output):
            return output  # None when the forward raised (this hook always runs)
        summed = DTensor.from_local(output, self.mesh, [Partial()], run_check=False)
        if layout is not None:  # a DTensor came in (sequence parallelism): one goes out, in the same layout
            return summed.redistribute(placements=layout)
        return summed.redistribute(placements=[Replicate()]).to_local()

    def _replicated(self, value: object) -> Any:
        """The whole tensor on this rank; a floating-point one's gradient is this rank's partial share."""
        if not torch.is_tensor(value):
            return value
        if isinstance(value, DTensor):
            value = value.redistribute(placements=[Replicate()])
        elif torch.is_floating_point(value):
            value = DTensor.from_local(value, self.mesh, [Replicate()], run_check=False)
        else:
            return value
        return value.to_local(grad_placements=[Partial()]) if torch.is_floating_point(value) else value.to_local()
