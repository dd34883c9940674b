"""The parallel styles a tensor-parallel plan names, and the one table from style name to style.

Torch's column- and row-wise styles extended to GPT-2's ``Conv1D`` (weight stored transposed), fused projections
(``[q | k | v]``, ``[gate | up]``: sharded chunk by chunk), projections inside global-shape regions (a DTensor with
the unsharded shape comes out), an LM head under loss parallelism and attention sinks on local heads. ``STYLES``
is the vocabulary: ``tensor_plan.STYLE_NAMES`` (what a ``tp_plan`` may name) is derived from it.
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from typing import Any, cast

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    RowwiseParallel,
    SequenceParallel,
)
from torch.distributed.tensor.placement_types import Placement
from typing_extensions import override

from lightning_mgpu._compat.dtensor import StyleHooks, strided_shard
from lightning_mgpu._compat.tensors import has_post_accumulate_grad_hook, version_counter
from lightning_mgpu.parallel.blocks import is_transposed_linear
from lightning_mgpu.parallel.tensor.embedding import VocabParallelEmbedding, reduce_lookups_in_forward
from lightning_mgpu.parallel.tensor.experts import PARAMETER_STYLES, ExpertsParallel, IdentityExpertParallel
from lightning_mgpu.parallel.tensor.local import marking_shards, owned_local
from lightning_mgpu.parallel.tensor.mixing import ShapeSwitch
from lightning_mgpu.parallel.tensor.multihead import STYLE as MULTIHEAD_STYLE
from lightning_mgpu.parallel.tensor.multihead import MultiheadAttentionParallel
from lightning_mgpu.parallel.tensor.parameters import distribute_parameters

SEQUENCE_DIM = 1

# The input and output hooks below return Any: `distribute_module` declares them as returning None, and uses what
# they return (a DTensor, a local tensor, the module's inputs).


def _output_dim(module: nn.Module) -> int:
    """Dimension of the weight indexing output features: 0 for Linear, 1 for GPT-2's transposed Conv1D."""
    return 1 if is_transposed_linear(module) else 0


class _Colwise(StyleHooks, ColwiseParallel):
    """Column-wise sharding of Linear/Conv1D outputs; ``chunks > 1`` shards each of a fused projection's chunks.

    A fused projection's bias stays replicated (DTensor slices it to match the output) so that data-parallel
    sharding can cut it along dim 0 without stacking two strided layouts on one dimension.
    """

    def __init__(self, chunks: int = 1, global_shapes: bool = False, **kwargs: Any) -> None:
        if global_shapes:  # the output stays a DTensor with the global shape (see region.py)
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
        output_fn: Callable[..., object]
        if fused:  # strided-shard output: to_local gives [q | k | v] of this rank's heads
            output_fn = _keep_output if self.global_shapes else _local_output
        else:
            output_fn = self.prepare_output
        if not self.global_shapes:  # a plain shard: its readers' replicated parameters get partial gradients
            output_fn = marking_shards(output_fn)
        if self.switch is not None:  # mixing.py
            output_fn = self.switch.output_fn(_keep_output, output_fn)
        distribute_module(
            module,
            device_mesh,
            partial(distribute_parameters, placements, self.src_data_rank),
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
        self.source: torch.Tensor | None = None
        self.version = -1
        self.converted: DTensor | None = None
        self.grad_enabled = False

    def open(self, *args: object) -> None:
        self.open_calls += 1
        self.source = self.converted = None

    def close(self, *args: object) -> None:
        self.open_calls = max(0, self.open_calls - 1)
        self.source = self.converted = None

    def hit(self, tensor: object) -> bool:
        return (
            self.open_calls > 0
            and tensor is self.source
            and self.grad_enabled == torch.is_grad_enabled()
            and version_counter(cast(torch.Tensor, tensor)) == self.version  # it is `self.source`
        )

    def keep(self, tensor: object, converted: DTensor) -> None:
        # Inference tensors (Lightning's evaluation under inference_mode) have no version counter: not shared.
        if self.open_calls > 0 and torch.is_tensor(tensor) and not tensor.is_inference():
            self.source, self.version, self.converted = tensor, version_counter(tensor), converted
            self.grad_enabled = torch.is_grad_enabled()  # a no_grad conversion must not serve a grad-enabled sibling


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
    def prepare_output(self, module: nn.Module, outputs: DTensor, device_mesh: DeviceMesh) -> torch.Tensor:
        if _loss_parallel_depth > 0:
            return super().prepare_output(module, outputs, device_mesh)
        return outputs.redistribute(placements=(Replicate(),)).to_local()


def keep_grad_placement(param: nn.Parameter) -> None:
    """Give a parameter's gradient the parameter's own layout, once, right after backward.

    A replicated parameter used on sharded activations (a fused projection's bias, norms and position embeddings
    under sequence parallelism) gets a sharded or partial gradient; a vocabulary-sharded embedding can get a
    replicated one. Left alone, optimizers would redistribute it on every use, or hold it at full size.
    """
    if isinstance(param, DTensor) and isinstance(param.grad, DTensor) and param.grad.placements != param.placements:
        param.grad = param.grad.redistribute(placements=param.placements)


def _arm_gradient_layout(module: nn.Module, args: tuple[object, ...]) -> None:
    """Forward pre-hook: make sure the module's current DTensor parameters carry the gradient-layout hook.

    Armed at every forward rather than once, because ``module.to()`` swaps parameter tensors (dropping their hooks)
    and FSDP2 registers its own unsharded parameters during forward.
    """
    for param in module.parameters(recurse=False):
        if isinstance(param, DTensor) and param.requires_grad and not has_post_accumulate_grad_hook(param):
            param.register_post_accumulate_grad_hook(keep_grad_placement)


class _Rowwise(StyleHooks, RowwiseParallel):
    """Row-wise sharding of Linear/Conv1D inputs; the partial outputs are all-reduced (or reduce-scattered)."""

    @override
    def apply_style(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if isinstance(module, nn.Embedding):  # vocabulary-parallel, as 'embedding_rowwise' (embedding.py)
            return reduce_lookups_in_forward(super().apply_style(module, device_mesh), self.output_layouts)
        self.desired_input_layouts = (Shard(-1),)
        placements = {"weight": Shard(1 - _output_dim(module)), "bias": Replicate()}
        return distribute_module(
            module,
            device_mesh,
            partial(distribute_parameters, placements, self.src_data_rank),
            self._input_fn,
            self.prepare_output,
        )

    @override
    def prepare_output(self, module: nn.Module, outputs: DTensor, device_mesh: DeviceMesh) -> Any:
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
            module, device_mesh, partial(distribute_parameters, placements, 0), self._input_fn, self._output_fn
        )

    @staticmethod
    def _input_fn(module: nn.Module, inputs: tuple, device_mesh: DeviceMesh) -> Any:
        first = inputs[0]
        if isinstance(first, DTensor) or not torch.is_tensor(first) or first.dim() < 2:
            return inputs
        return (DTensor.from_local(first, device_mesh, [Shard(first.dim() - 2)], run_check=False), *inputs[1:])

    @staticmethod
    def _output_fn(module: nn.Module, outputs: object, device_mesh: DeviceMesh) -> Any:
        return outputs.to_local() if isinstance(outputs, DTensor) else outputs


def _local_output(module: nn.Module, outputs: DTensor, device_mesh: DeviceMesh) -> Any:
    return outputs.to_local()


def _keep_output(module: nn.Module, outputs: DTensor, device_mesh: DeviceMesh) -> Any:
    return outputs


@dataclass(frozen=True)
class _Layouts:
    """What a style is built for: the residual stream's layout between blocks and where the projection sits."""

    sequence_parallel: bool
    global_shapes: bool

    @property
    def replicated(self) -> Placement:
        return Replicate()

    @property
    def stream(self) -> Placement:
        return Shard(SEQUENCE_DIM) if self.sequence_parallel else self.replicated


def _rowwise(at: _Layouts, input_layouts: Placement | None = None) -> ParallelStyle:
    return _Rowwise(input_layouts=input_layouts, output_layouts=at.stream, use_local_output=not at.sequence_parallel)


def _multihead_attention(at: _Layouts) -> ParallelStyle:
    if at.sequence_parallel:
        raise ValueError(
            f"'{MULTIHEAD_STYLE}' (torch's nn.MultiheadAttention sharded by heads) takes and returns whole sequences;"
            " sequence_parallel=True would hand it sequence shards. Use tensor parallelism without"
            " sequence_parallel for this model."
        )
    return MultiheadAttentionParallel()


# The style names a plan may give a module, and how each is built: the one vocabulary (``tensor_plan.STYLE_NAMES``
# adds the names that place a parameter of an experts module).
STYLES: dict[str, Callable[[_Layouts], ParallelStyle | None]] = {
    "colwise": lambda at: _Colwise(input_layouts=at.stream, global_shapes=at.global_shapes),
    "colwise_qkv": lambda at: _Colwise(chunks=3, input_layouts=at.stream, global_shapes=at.global_shapes),
    # A packed [gate | up] (Phi-3's gate_up_proj, split with chunk(2)): each rank holds its halves of both.
    "colwise_gate_up": lambda at: _Colwise(chunks=2, input_layouts=at.stream, global_shapes=at.global_shapes),
    "colwise_gather_output": lambda at: _Colwise(input_layouts=at.stream, output_layouts=at.replicated),
    # An LM head under loss_parallel: logits stay a DTensor sharded over the vocabulary inside steps.
    "colwise_loss_parallel": lambda at: _LossParallelHead(input_layouts=at.stream),
    "rowwise": lambda at: _rowwise(at),
    # Its input is whole on every rank (Phi-3 gathers its fused q|k|v, gate|up to slice them): each rank
    # multiplies its own slice of it, then the partial outputs are all-reduced.
    "rowwise_split_input": lambda at: _rowwise(at, input_layouts=at.replicated),
    "replicated_with_grad_allreduce": lambda at: _ReplicatedOnLocalHeads(),
    # torch's nn.MultiheadAttention (its packed in-projection and output projection) sharded by heads.
    MULTIHEAD_STYLE: _multihead_attention,
    "embedding_rowwise": lambda at: VocabParallelEmbedding(
        input_layouts=at.replicated, output_layouts=at.stream, use_local_output=not at.sequence_parallel
    ),
    "embedding_colwise": lambda at: ColwiseParallel(
        input_layouts=at.replicated, output_layouts=at.stream, use_local_output=not at.sequence_parallel
    ),
    "sequence_parallel": lambda at: SequenceParallel(use_local_output=False) if at.sequence_parallel else None,
    "replicate": lambda at: None,
    # Experts on local shards of their 3-D parameters (tensor/experts.py); placements set by place_experts.
    "moe_tp_experts": lambda at: ExpertsParallel(),
    "moe_identity_expert": lambda at: IdentityExpertParallel(),
}


def style(name: str, sequence_parallel: bool, global_shapes: bool = False) -> ParallelStyle | None:
    """The torch ParallelStyle for a plan's style name (``None`` for ``"replicate"``).

    ``global_shapes``: a column-parallel projection inside a global-shape region returns a DTensor with the
    unsharded shape instead of this rank's plain shard.
    """
    if name not in STYLES and name in PARAMETER_STYLES:
        raise ValueError(
            f"{name!r} places a parameter of a 'moe_tp_experts' module (e.g. '<experts>.gate_up_proj'),"
            " not a module: give it to that parameter in `tp_plan`."
        )
    if name not in STYLES:
        raise ValueError(f"Unknown tensor-parallel style {name!r} in `tp_plan`. Known styles: {sorted(STYLES)}.")
    return STYLES[name](_Layouts(sequence_parallel, global_shapes))
