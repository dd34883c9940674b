"""Tensor parallelism (+ sequence parallelism) with DTensor over the layout's ``tp`` axis.

A *plan* maps module names (``fnmatch`` globs over FQNs) to style names; styles are torch's parallel styles,
extended to GPT-2's ``Conv1D`` (weight stored transposed) and to fused projections such as nanoGPT's ``c_attn``
(``[q | k | v]`` in one Linear), which are sharded chunk by chunk with ``_StridedShard`` so that each rank holds
the q, k and v of its own heads and the full tensor keeps its original layout.

``tp_plan="auto"`` (``plan.py``) takes Hugging Face's own plans (``config.base_model_tp_plan`` and the model
class's ``_tp_plan``) where present, and name rules for GPT-style blocks otherwise.

What the code between the projections sees (``_global_shape_regions``): modules of a Hugging Face model that
declares a tensor-parallel plan get plain per-rank tensors, as Hugging Face's own tensor parallelism gives them
(their code reshapes with ``-1`` and ``head_dim``, never with a global head count). Every other parent of
column-parallel projections is a *global-shape region* (``region.py``): its projections hand back DTensors
with the unsharded shapes, so code that reads ``C`` from its input or ``n_head``/``n_embd`` from its config works
unchanged. No attribute of the user's modules is rewritten. Two refinements of plain shards: a region whose code
mixes values across the sharded width (a mean over an MLP's features) moves to global shapes (``mixing.py``),
and per-head parameters and per-head row-parallel outputs of an attention follow its heads (``heads.py``).
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from contextlib import ExitStack, contextmanager
from typing import Any, cast

import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import (
    ParallelStyle,
    parallelize_module,
)
from torch.overrides import TorchFunctionMode

from lightning_mgpu.parallel.blocks import tied_parameters
from lightning_mgpu.parallel.example import ExampleStep
from lightning_mgpu.parallel.tensor.adapters import adapter_projections, through_adapters
from lightning_mgpu.parallel.tensor.checks import check_divisible, parent_name
from lightning_mgpu.parallel.tensor.experts import place_experts
from lightning_mgpu.parallel.tensor.heads import per_head_outputs, shard_per_head_parameters, split_per_head_inputs
from lightning_mgpu.parallel.tensor.local import watch_shard_parameters
from lightning_mgpu.parallel.tensor.mixing import move_mixing_regions, shape_switches
from lightning_mgpu.parallel.tensor.plan import (
    _hugging_face_models,
    _match,
    _with_vocab_parallel_head,
    auto_plan,
    with_network_copies,
)
from lightning_mgpu.parallel.tensor.region import install_global_shape_region
from lightning_mgpu.parallel.tensor.styles import (
    _arm_gradient_layout,
    _Colwise,
    _Rowwise,
    _SharedInput,
    _vocab_parallel_loss,
    style,
)

Plan = str | dict[str, str] | Callable[[nn.Module, DeviceMesh], None]


def _retie(module: nn.Module, groups: list[list[tuple[str, str]]]) -> None:
    """Sharding a tied weight gives each holder its own copy: hold one again, or refuse if layouts differ."""
    for group in groups:
        params = [getattr(module.get_submodule(m), p) for m, p in group]
        if all(p is params[0] for p in params):
            continue
        layouts = {p.placements if isinstance(p, DTensor) else None for p in params}
        names = [f"{m}.{p}" if m else p for m, p in group]
        if len(layouts) > 1:
            raise ValueError(
                f"{' and '.join(names)} are one tied weight, but the tensor-parallel plan shards them differently"
                f" ({', '.join(str(layout) for layout in layouts)}). Give their modules matching styles (a head"
                " 'colwise*' with its embedding 'embedding_rowwise') or 'replicate' both, or untie them."
            )
        for module_name, param_name in group[1:]:
            module.get_submodule(module_name).register_parameter(param_name, params[0])


# ----------------------------------------------------------------------------------------------------- apply
def apply(
    module: nn.Module,
    tp_mesh: DeviceMesh,
    tp_plan: Plan,
    sequence_parallel: bool,
    loss_parallel: bool = False,
    example: ExampleStep | None = None,
) -> None:
    """Shard ``module`` in place over ``tp_mesh`` following ``tp_plan`` (``"auto"`` may read the blocks' real call
    from ``example``, the user's step on one batch)."""
    if callable(tp_plan):
        tp_plan(module, tp_mesh)
        return
    if _already_parallelized(module):
        return  # the user's configure_model applied its own plan with `self.device_mesh`
    plan = auto_plan(module, sequence_parallel, example) if tp_plan == "auto" else dict(cast(dict[str, str], tp_plan))
    if loss_parallel:
        plan = _with_vocab_parallel_head(module, plan)
    matched = through_adapters(module, with_network_copies(module, _match(module, plan)))
    tp = tp_mesh.size()
    check_divisible(module, matched, tp)
    regions, local = _regions(module, matched)
    styles = {fqn: style(name, sequence_parallel, global_shapes=fqn in regions) for fqn, name in matched.items()}
    switches = shape_switches(module, set(local.values()))
    for fqn, region in local.items():
        cast(_Colwise, styles[fqn]).switch = switches.get(region)
    adapters = adapter_projections(module, matched)
    for fqn in per_head_outputs(module, matched, set(local.values())):  # reduce-scattered to the rank's heads
        if fqn not in adapters:
            styles[fqn] = _Rowwise(output_layouts=Shard(-1))
    place_experts(module, plan, matched, styles, tp, sequence_parallel)
    _share_inputs(module, matched, styles)
    tied = tied_parameters(module)
    frozen = {name for name, p in module.named_parameters(remove_duplicate=False) if not p.requires_grad}
    parallelize_module(module, tp_mesh, {fqn: s for fqn, s in styles.items() if s is not None})
    for name in sorted(set(regions.values())):
        install_global_shape_region(module.get_submodule(name))
    shard_per_head_parameters(module, set(local.values()), set(matched), tp_mesh)  # attentions: never moved below
    if sequence_parallel:
        _replicate_remaining(module, tp_mesh)
    _retie(module, tied)
    plain = set(local.values()) - set(move_mixing_regions(module, switches, local, tp_mesh, sequence_parallel))
    split_per_head_inputs(module, plain, tp_mesh)
    watch_shard_parameters(module, sorted(plain), set(matched), tp_mesh)
    _keep_frozen(module, frozen)
    for child in module.modules():
        if any(isinstance(p, DTensor) for p in child.parameters(recurse=False)):
            child.register_forward_pre_hook(_arm_gradient_layout)


def _keep_frozen(module: nn.Module, frozen: set[str]) -> None:
    """Frozen parameters stay frozen: torch's styles re-register each parameter they distribute as a new
    ``nn.Parameter``, which requires a gradient (``SequenceParallel`` does so for the norms), so a frozen layer
    under sequence parallelism would train its norms."""
    for name, param in module.named_parameters(remove_duplicate=False):
        if name in frozen and param.requires_grad:
            param.requires_grad_(False)


def _share_inputs(module: nn.Module, matched: dict[str, str], styles: dict[str, ParallelStyle | None]) -> None:
    """Parents with several column-parallel children (HF attention's q/k/v, a SwiGLU's gate/up) convert the input
    those children read once for all of them (see ``_SharedInput``)."""
    children: dict[str, list[_Colwise]] = {}
    for fqn, name in matched.items():
        if name in ("colwise", "colwise_qkv") and "." in fqn and isinstance(styles[fqn], _Colwise):
            children.setdefault(fqn.rsplit(".", 1)[0], []).append(styles[fqn])  # type: ignore[arg-type]
    for holder, colwise in children.items():
        if len(colwise) < 2:
            continue
        shared = _SharedInput()
        parent = module.get_submodule(holder)
        parent.register_forward_pre_hook(shared.open)
        parent.register_forward_hook(shared.close, always_call=True)
        for child_style in colwise:
            child_style.shared = shared


def _replicate_remaining(module: nn.Module, tp_mesh: DeviceMesh) -> None:
    """Under sequence parallelism activations are DTensors, so every parameter must be one too (replicated)."""
    for child in module.modules():
        for name, param in list(child.named_parameters(recurse=False)):
            if not isinstance(param, DTensor):
                replicated = distribute_tensor(param.detach(), tp_mesh, [Replicate()])
                child.register_parameter(name, nn.Parameter(replicated, requires_grad=param.requires_grad))


def _already_parallelized(module: nn.Module) -> bool:
    return any(isinstance(p, DTensor) for p in module.parameters())


def _global_shape_regions(module: nn.Module, matched: dict[str, str]) -> dict[str, str]:
    return _regions(module, matched)[0]


def _regions(module: nn.Module, matched: dict[str, str]) -> tuple[dict[str, str], dict[str, str]]:
    """``{column-parallel projection: module whose forward is its global-shape region}``, and the same for the
    projections of Hugging Face models, whose region runs on plain per-rank shards.

    The region of a projection is its nearest ancestor that also holds a row-parallel projection (the attention or
    MLP between the two), or its parent where none does.

    Decided from the model's structure, not by trying the module: only code known to be written for per-rank
    shards gets them, i.e. the modules of a Hugging Face model that declares a tensor-parallel plan (Hugging Face
    runs them on plain shards itself). A trial forward in local mode could only catch code that crashes, not code
    that reshapes wrongly without an error (``view(B, T, self.nh, -1)`` with a global head count gives each rank
    heads of the wrong size), and it would need the module's real call arguments (litgpt passes ``cos``, ``sin``,
    a mask), which do not exist before training. Global shapes are right for any code that is right unsharded.
    """
    local_prefixes = [prefix for prefix, _ in _hugging_face_models(module)]
    rowwise = [name for name, style_name in matched.items() if style_name == "rowwise"]
    regions: dict[str, str] = {}
    local: dict[str, str] = {}
    for name, style_name in matched.items():
        if style_name not in ("colwise", "colwise_qkv", "colwise_gate_up") or "." not in name:
            continue
        region = ancestor = parent_name(name)
        while ancestor:
            if any(row.startswith(ancestor + ".") for row in rowwise):
                region = ancestor
                break
            ancestor = parent_name(ancestor)
        # A packed gate|up is split by chunk(2), which only a region serves without gathering: Hugging Face's too.
        if style_name != "colwise_gate_up" and any(
            prefix == "" or name.startswith(prefix + ".") for prefix in local_prefixes
        ):
            local[name] = region
        else:
            regions[name] = region
    return regions, local


@contextmanager
def tensor_parallel_context(sequence_parallel: bool, loss_parallel: bool = False) -> Generator[None, None, None]:
    """Around each step and its backward (the strategy enters it for both, also around a pipeline schedule).

    With sequence parallelism the residual stream is a DTensor, and plain tensors added to it (position
    embeddings, masks) are treated as replicated. With ``loss_parallel`` torch's vocabulary-parallel
    cross-entropy runs on the sharded logits (its backward needs the same context, hence around backward too),
    and its (replicated) result is handed back as a plain tensor so that Lightning's loss handling and
    ``self.log`` see what they always see.
    """
    with ExitStack() as stack:
        if sequence_parallel:
            from torch.distributed.tensor.experimental import implicit_replication

            stack.enter_context(implicit_replication())
        if loss_parallel:
            stack.enter_context(_vocab_parallel_loss())
            stack.enter_context(_PlainLosses())
        yield


class _PlainLosses(TorchFunctionMode):
    """Return the replicated DTensor that a cross-entropy on sharded logits gives as its local (full) value.

    ``F.cross_entropy``/``F.nll_loss`` (``nn.CrossEntropyLoss`` and Hugging Face's ``ForCausalLMLoss`` call the
    former) return a DTensor replicated over the tensor-parallel ranks; Lightning would then log, reduce and
    accumulate a DTensor (``sync_dist`` all-reduces it, and adding it to plain tensors fails). ``to_local`` is
    differentiable: backward re-enters the DTensor graph, still inside ``loss_parallel``.
    """

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        result = func(*args, **(kwargs or {}))
        if func in (F.cross_entropy, F.nll_loss) and isinstance(result, DTensor):
            if all(p.is_replicate() for p in result.placements):
                return result.to_local()
        return result
