"""Tensor parallelism (+ sequence parallelism) with DTensor over the layout's ``tp`` axis.

A *plan* maps module names (``fnmatch`` globs over FQNs) to style names; styles are torch's parallel styles,
extended to GPT-2's ``Conv1D`` (weight stored transposed) and to fused projections such as nanoGPT's ``c_attn``
(``[q | k | v]`` in one Linear), which are sharded chunk by chunk with ``_StridedShard`` so that each rank holds
the q, k and v of its own heads and the full tensor keeps its original layout.

``tp_plan="auto"`` (``tensor_plan.py``) takes Hugging Face's own plans (``config.base_model_tp_plan`` and the model
class's ``_tp_plan``) where present, and name rules for GPT-style blocks otherwise.

What the code between the projections sees (``_regions``): modules of a Hugging Face model that
declares a tensor-parallel plan get plain per-rank tensors, as Hugging Face's own tensor parallelism gives them
(their code reshapes with ``-1`` and ``head_dim``, never with a global head count). Every other parent of
column-parallel projections is a *global-shape region* (``tensor_region.py``): its projections hand back DTensors
with the unsharded shapes, so code that reads ``C`` from its input or ``n_head``/``n_embd`` from its config works
unchanged. No attribute of the user's modules is rewritten. Two refinements of plain shards: a region whose code
mixes values across the sharded width (a mean over an MLP's features) moves to global shapes (``tensor_mixing.py``),
and per-head parameters and per-head row-parallel outputs of an attention follow its heads (``tensor_heads.py``).
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from contextlib import ExitStack, contextmanager
from functools import partial
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)
from torch.overrides import TorchFunctionMode
from typing_extensions import override

from lightning_mgpu._compat.dtensor import StyleHooks, strided_shard
from lightning_mgpu._compat.tensors import has_post_accumulate_grad_hook, version_counter
from lightning_mgpu.parallel.blocks import is_transposed_linear, tied_parameters
from lightning_mgpu.parallel.tensor_checks import check_divisible, parent_name
from lightning_mgpu.parallel.tensor_embedding import VocabParallelEmbedding, reduce_lookups_in_forward
from lightning_mgpu.parallel.tensor_experts import ExpertsParallel, IdentityExpertParallel, place_experts
from lightning_mgpu.parallel.tensor_heads import per_head_outputs, shard_per_head_parameters, split_per_head_inputs
from lightning_mgpu.parallel.tensor_local import marking_shards, owned_local, watch_shard_parameters
from lightning_mgpu.parallel.tensor_mixing import ShapeSwitch, move_mixing_regions, shape_switches
from lightning_mgpu.parallel.tensor_plan import _hugging_face_models, _match, _with_vocab_parallel_head, auto_plan
from lightning_mgpu.parallel.tensor_region import install_global_shape_region

Plan = str | dict[str, str] | Callable[[nn.Module, DeviceMesh], None]

SEQUENCE_DIM = 1


def _output_dim(module: nn.Module) -> int:
    """Dimension of the weight indexing output features: 0 for Linear, 1 for GPT-2's transposed Conv1D."""
    return 1 if is_transposed_linear(module) else 0


class _Colwise(StyleHooks, ColwiseParallel):
    """Column-wise sharding of Linear/Conv1D outputs; ``chunks > 1`` shards each of a fused projection's chunks.

    A fused projection's bias stays replicated (DTensor slices it to match the output) so that data-parallel
    sharding can cut it along dim 0 without stacking two strided layouts on one dimension.
    """

    def __init__(self, chunks: int = 1, global_shapes: bool = False, **kwargs: Any) -> None:
        if global_shapes:  # the output stays a DTensor with the global shape (see tensor_region.py)
            kwargs.update(output_layouts=Shard(-1), use_local_output=False)
        super().__init__(**kwargs)
        self.chunks = chunks
        self.global_shapes = global_shapes
        self.shared: _SharedInput | None = None  # set when siblings read the same input (see _share_inputs)
        self.switch: ShapeSwitch | None = None  # set in a plain-shard region that may move to global shapes

    @override
    def apply_style(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if isinstance(module, nn.Embedding):
            return super().apply_style(module, device_mesh)
        dim = _output_dim(module)
        fused = self.chunks > 1
        placements = (
            {"weight": strided_shard(dim, self.chunks), "bias": Replicate()}
            if fused
            else {"weight": Shard(dim), "bias": Shard(0)}
        )
        output_fn: Callable[..., Any]
        if fused:  # strided-shard output: to_local gives [q | k | v] of this rank's heads
            output_fn = _keep_output if self.global_shapes else _local_output
        else:
            output_fn = self.prepare_output
        if not self.global_shapes:  # a plain shard: its readers' replicated parameters get partial gradients
            output_fn = marking_shards(output_fn)
        if self.switch is not None:  # tensor_mixing.py
            output_fn = self.switch.output_fn(_keep_output, output_fn)
        distribute_module(
            module,
            device_mesh,
            partial(_distribute_parameters, placements, self.src_data_rank),
            self._input_fn,
            output_fn,
        )
        return module

    def _input_fn(self, module: nn.Module, inputs: tuple, device_mesh: DeviceMesh) -> Any:
        shared = self.shared
        if shared is not None and shared.hit(inputs[0]):
            return shared.converted
        converted = self.prepare_input(module, inputs, device_mesh)
        if shared is not None:
            shared.keep(inputs[0], converted)
        return converted


class _SharedInput:
    """One parent's conversion of the input its column-parallel children read, shared by those children.

    Hugging Face attention calls ``q_proj(x)``, ``k_proj(x)``, ``v_proj(x)`` and its MLP ``gate_proj(x)``,
    ``up_proj(x)``: converted per child, ``x`` becomes 3 (2) separate DTensors, and backward reduces each one's
    partial input gradient on its own (all-reduces, or reduce-scatters under sequence parallelism; forward also
    all-gathers 3 times under SP). Sharing the first child's DTensor with its siblings makes autograd sum the
    partial gradients first, so one collective serves the whole parent, as Megatron-LM's single region does.

    torchtitan gets this with ``PrepareModuleInput`` on the parent; that hands the parent's own body a DTensor
    (a residual add or any plain-tensor op on the input then fails or leaks a DTensor) and must know how the
    parent is called (HF passes ``hidden_states=`` by keyword, GPT-style code positionally). Sharing inside the
    children assumes neither: the parent's body sees exactly what it saw before. The cache lives only during the
    parent's forward (opened and closed by its hooks, also when it raises) and matches the very same tensor
    object at the same version, so a different or in-place-modified input is converted anew.
    """

    def __init__(self) -> None:
        self.open_calls = 0
        self.source: Any = None
        self.version = -1
        self.converted: DTensor | None = None
        self.grad_enabled = False

    def open(self, *args: Any) -> None:
        self.open_calls += 1
        self.source = self.converted = None

    def close(self, *args: Any) -> None:
        self.open_calls = max(0, self.open_calls - 1)
        self.source = self.converted = None

    def hit(self, tensor: Any) -> bool:
        return (
            self.open_calls > 0
            and tensor is self.source
            and self.grad_enabled == torch.is_grad_enabled()
            and version_counter(tensor) == self.version
        )

    def keep(self, tensor: Any, converted: DTensor) -> None:
        # Inference tensors (Lightning's evaluation under inference_mode) have no version counter: not shared.
        if self.open_calls > 0 and torch.is_tensor(tensor) and not tensor.is_inference():
            self.source, self.version, self.converted = tensor, version_counter(tensor), converted
            self.grad_enabled = torch.is_grad_enabled()  # a no_grad conversion must not serve a grad-enabled sibling


class _LossParallelHead(_Colwise):
    """An LM head for ``loss_parallel``: column-wise over the vocabulary, its logits gathered only where needed.

    Inside :func:`tensor_parallel_context` with loss parallelism on (training/validation/test steps and their
    backward) the logits stay a DTensor sharded on the last dimension (``Shard(-1)``), which torch's parallel
    cross-entropy consumes without ever materializing ``b x s x V`` on a rank. Anywhere else (``predict_step``,
    ``generate()`` in a callback, a user's own forward outside a step) they are all-gathered into the plain tensor an
    unsharded head returns, so code that samples or takes an ``argmax`` keeps working.
    """

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(output_layouts=Shard(-1), use_local_output=False, **kwargs)

    @override
    def prepare_output(self, module: nn.Module, outputs: DTensor, device_mesh: DeviceMesh) -> Any:
        if _loss_parallel_depth > 0:
            return super().prepare_output(module, outputs, device_mesh)
        return outputs.redistribute(placements=(Replicate(),)).to_local()


def _keep_grad_placement(param: nn.Parameter) -> None:
    """Give a parameter's gradient the parameter's own layout, once, right after backward.

    A replicated parameter used on sharded activations (a fused projection's bias, norms and position embeddings
    under sequence parallelism) gets a sharded or partial gradient; a vocabulary-sharded embedding can get a
    replicated one. Left alone, optimizers would redistribute it on every use, or hold it at full size.
    """
    if isinstance(param, DTensor) and isinstance(param.grad, DTensor) and param.grad.placements != param.placements:
        param.grad = param.grad.redistribute(placements=param.placements)


def _arm_gradient_layout(module: nn.Module, args: Any) -> None:
    """Forward pre-hook: make sure the module's current DTensor parameters carry the gradient-layout hook.

    Armed at every forward rather than once, because ``module.to()`` swaps parameter tensors (dropping their hooks)
    and FSDP2 registers its own unsharded parameters during forward.
    """
    for param in module.parameters(recurse=False):
        if isinstance(param, DTensor) and param.requires_grad and not has_post_accumulate_grad_hook(param):
            param.register_post_accumulate_grad_hook(_keep_grad_placement)


class _Rowwise(StyleHooks, RowwiseParallel):
    """Row-wise sharding of Linear/Conv1D inputs; the partial outputs are all-reduced (or reduce-scattered)."""

    @override
    def apply_style(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if isinstance(module, nn.Embedding):  # vocabulary-parallel, as 'embedding_rowwise' (tensor_embedding.py)
            return reduce_lookups_in_forward(super().apply_style(module, device_mesh), self.output_layouts)
        self.desired_input_layouts = (Shard(-1),)
        placements = {"weight": Shard(1 - _output_dim(module)), "bias": Replicate()}
        return distribute_module(
            module,
            device_mesh,
            partial(_distribute_parameters, placements, self.src_data_rank),
            self._input_fn,
            self.prepare_output,
        )

    @override
    def prepare_output(self, module: nn.Module, outputs: Any, device_mesh: DeviceMesh) -> Any:
        if tuple(outputs.placements) != tuple(self.output_layouts):  # as torch's RowwiseParallel
            outputs = outputs.redistribute(placements=self.output_layouts, async_op=True)
        return owned_local(outputs) if self.use_local_output else outputs

    def _input_fn(self, module: nn.Module, inputs: tuple, device_mesh: DeviceMesh) -> Any:
        # From a global-shape region the input is already a DTensor, normally sharded on its last dimension; one in
        # another layout (code in the region that replicated it) is brought to that layout (a local slice).
        first = inputs[0]
        if isinstance(first, DTensor):
            wanted = (Shard(first.dim() - 1),)
            return first if tuple(first.placements) == wanted else first.redistribute(placements=wanted)
        return self.prepare_input(module, inputs, device_mesh)


class _ReplicatedOnLocalHeads(StyleHooks, ParallelStyle):
    """A replicated module applied to this rank's heads only (Qwen3's per-head ``q_norm``/``k_norm`` between a
    column- and a row-parallel projection): its parameters become replicated DTensors and its plain input this
    rank's shard of the heads (dimension -2 of ``[..., heads, head_dim]``), so the parameter gradient is a partial
    sum that is all-reduced into the replicated gradient (Hugging Face's ``replicated_with_grad_allreduce``).
    The forward needs no communication; the module returns plain tensors, as it did.
    """

    @override
    def apply_style(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        placements = {name: Replicate() for name, _ in module.named_parameters(recurse=False)}
        return distribute_module(
            module, device_mesh, partial(_distribute_parameters, placements, 0), self._input_fn, self._output_fn
        )

    @staticmethod
    def _input_fn(module: nn.Module, inputs: tuple, device_mesh: DeviceMesh) -> Any:
        first = inputs[0]
        if isinstance(first, DTensor) or not torch.is_tensor(first) or first.dim() < 2:
            return inputs
        return (DTensor.from_local(first, device_mesh, [Shard(first.dim() - 2)], run_check=False), *inputs[1:])

    @staticmethod
    def _output_fn(module: nn.Module, outputs: Any, device_mesh: DeviceMesh) -> Any:
        return outputs.to_local() if isinstance(outputs, DTensor) else outputs


def _distribute_parameters(
    placements: dict, src_data_rank: int | None, name: str, module: nn.Module, mesh: DeviceMesh
) -> None:
    for param_name, placement in placements.items():
        param = getattr(module, param_name, None)
        if param is None or isinstance(param, DTensor):
            continue
        distributed = distribute_tensor(param, mesh, [placement], src_data_rank=src_data_rank)
        module.register_parameter(param_name, nn.Parameter(distributed, requires_grad=param.requires_grad))


def _local_output(module: nn.Module, outputs: DTensor, device_mesh: DeviceMesh) -> Any:
    return outputs.to_local()


def _keep_output(module: nn.Module, outputs: DTensor, device_mesh: DeviceMesh) -> Any:
    return outputs


def style(name: str, sequence_parallel: bool, global_shapes: bool = False) -> ParallelStyle | None:
    """The torch ParallelStyle for a plan's style name (``None`` for ``"replicate"``).

    ``global_shapes``: a column-parallel projection inside a global-shape region returns a DTensor with the
    unsharded shape instead of this rank's plain shard.
    """
    sequence, replicated = Shard(SEQUENCE_DIM), Replicate()
    stream = sequence if sequence_parallel else replicated  # layout of the residual stream between blocks
    styles: dict[str, Callable[[], ParallelStyle | None]] = {
        "colwise": lambda: _Colwise(input_layouts=stream, global_shapes=global_shapes),
        "colwise_qkv": lambda: _Colwise(chunks=3, input_layouts=stream, global_shapes=global_shapes),
        # A packed [gate | up] (Phi-3's gate_up_proj, split with chunk(2)): each rank holds its halves of both.
        "colwise_gate_up": lambda: _Colwise(chunks=2, input_layouts=stream, global_shapes=global_shapes),
        "colwise_gather_output": lambda: _Colwise(input_layouts=stream, output_layouts=replicated),
        # An LM head under loss_parallel: logits stay a DTensor sharded over the vocabulary inside steps.
        "colwise_loss_parallel": lambda: _LossParallelHead(input_layouts=stream),
        "rowwise": lambda: _Rowwise(output_layouts=stream, use_local_output=not sequence_parallel),
        # Its input is whole on every rank (Phi-3 gathers its fused q|k|v, gate|up to slice them): each rank
        # multiplies its own slice of it, then the partial outputs are all-reduced.
        "rowwise_split_input": lambda: _Rowwise(
            input_layouts=replicated, output_layouts=stream, use_local_output=not sequence_parallel
        ),
        "replicated_with_grad_allreduce": lambda: _ReplicatedOnLocalHeads(),
        "embedding_rowwise": lambda: VocabParallelEmbedding(
            input_layouts=replicated, output_layouts=stream, use_local_output=not sequence_parallel
        ),
        "embedding_colwise": lambda: ColwiseParallel(
            input_layouts=replicated, output_layouts=stream, use_local_output=not sequence_parallel
        ),
        "sequence_parallel": lambda: SequenceParallel(use_local_output=False) if sequence_parallel else None,
        "replicate": lambda: None,
        # Experts on local shards of their 3-D parameters (tensor_experts.py); placements set by place_experts.
        "moe_tp_experts": lambda: ExpertsParallel(),
        "moe_identity_expert": lambda: IdentityExpertParallel(),
    }
    if name in ("packed_colwise", "packed_rowwise"):
        raise ValueError(
            f"{name!r} places a parameter of a 'moe_tp_experts' module (e.g. '<experts>.gate_up_proj'),"
            " not a module: give it to that parameter in `tp_plan`."
        )
    if name not in styles:
        raise ValueError(f"Unknown tensor-parallel style {name!r} in `tp_plan`. Known styles: {sorted(styles)}.")
    return styles[name]()


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
def apply_tensor_parallel(
    module: nn.Module, tp_mesh: DeviceMesh, tp_plan: Plan, sequence_parallel: bool, loss_parallel: bool = False
) -> None:
    """Shard ``module`` in place over ``tp_mesh`` following ``tp_plan``."""
    if callable(tp_plan):
        tp_plan(module, tp_mesh)
        return
    if _already_parallelized(module):
        return  # the user's configure_model applied its own plan with `self.device_mesh`
    plan = auto_plan(module, sequence_parallel) if tp_plan == "auto" else dict(cast(dict[str, str], tp_plan))
    if loss_parallel:
        plan = _with_vocab_parallel_head(module, plan)
    matched = _match(module, plan)
    tp = tp_mesh.size()
    check_divisible(module, matched, tp)
    regions, local = _regions(module, matched)
    styles = {fqn: style(name, sequence_parallel, global_shapes=fqn in regions) for fqn, name in matched.items()}
    switches = shape_switches(module, set(local.values()))
    for fqn, region in local.items():
        cast(_Colwise, styles[fqn]).switch = switches.get(region)
    for fqn in per_head_outputs(module, matched, set(local.values())):  # reduce-scattered to the rank's heads
        styles[fqn] = _Rowwise(output_layouts=Shard(-1))
    place_experts(module, plan, matched, styles, tp, sequence_parallel)
    _share_inputs(module, matched, styles)
    tied = tied_parameters(module)
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
    for child in module.modules():
        if any(isinstance(p, DTensor) for p in child.parameters(recurse=False)):
            child.register_forward_pre_hook(_arm_gradient_layout)


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


_loss_parallel_depth = 0  # how many _vocab_parallel_loss contexts are open (the head reads it)


@contextmanager
def _vocab_parallel_loss() -> Generator[None, None, None]:
    """torch's ``loss_parallel()``, made reentrant and exception-safe.

    torch's context manager switches its DTensor cross-entropy handlers on at entry and off at exit, without
    ``try/finally`` and without counting. Nested (manual optimization's ``manual_backward`` inside a step enters
    the context again) the inner exit would switch them off for the rest of the outer step, and the outer exit
    raise ``KeyError``; an exception would leave them on for the rest of the process. Only the outermost level
    enters torch's context here, and it is always left.
    """
    global _loss_parallel_depth
    from torch.distributed.tensor.parallel import loss_parallel

    outermost = loss_parallel() if _loss_parallel_depth == 0 else None
    if outermost is not None:
        outermost.__enter__()
    _loss_parallel_depth += 1
    try:
        yield
    finally:
        _loss_parallel_depth -= 1
        if outermost is not None:
            outermost.__exit__(None, None, None)  # resumes torch's generator past its yield: handlers off


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
