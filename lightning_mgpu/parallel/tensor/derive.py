"""A tensor-parallel plan derived from a block's structure, for models without a plan (BERT, torchtitan-style and
encoder-decoder blocks, torch's own ``nn.Transformer*Layer``: any block whose projection names the GPT-block rules
do not know).

Block 0 is followed through one call while a ``TorchFunctionMode`` records where each tensor comes from: the block
input (the hidden states), another argument of the call (rotary frequencies, a mask, an encoder's output), or the
output of one projection (a ``Linear`` or GPT-2 ``Conv1D``, recognised by its weight among the arguments of any
operation; an ``nn.MultiheadAttention`` counts as one unit, its single ``F.multi_head_attention_forward`` call). The
call is the block's real one inside the model's forward: the user's step is run on one batch of the training data
(``parallel/example.py``: no gradient, nothing of it kept) and ended right after the block. Where that cannot run
(no batch before training, a step that cannot run before the optimizers exist), block 0 is run once on fake hidden
states instead (``FakeTensorMode``: no computation, no random numbers drawn), which serves blocks that take nothing
else. From that data flow, Megatron-LM's split follows without reading a single module name:

- a projection whose output reaches the block output without passing another projection *writes into the residual
  stream*; the stream is the block input plus what those writers add to it;
- a projection that reads the stream (or the call's other arguments) and does not write into it is
  **column-parallel** (q/k/v, cross-attention's k/v of the encoder's output, an MLP's up-projection);
- a writer whose input comes only from column-parallel outputs (and the call's other arguments: a position bias, a
  mask) is **row-parallel** (the attention output, an MLP's down-projection);
- an ``nn.MultiheadAttention`` is sharded whole by its heads ('multihead_attention', ``multihead.py``).

Anything else (a projection between two others, one that reads and writes the stream, one the trace never reached)
cannot be split this way: the error names it with the explicit plan to pass. Head counts are not guessed here: the
divisibility check reads them from the attention module or its config (``checks.py``). A derived plan runs
through global-shape regions (``region.py``), so the block's own shape arithmetic stays untouched; it is
logged so that it can be pinned as an explicit ``tp_plan``.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Any, NoReturn

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import nn
from torch.overrides import TorchFunctionMode

from lightning_mgpu._compat.tensors import fake_tensor_mode, tree_flatten
from lightning_mgpu.parallel.blocks import block_glob, is_projection, projection_features
from lightning_mgpu.parallel.example import ExampleStep, instance_attribute, restore_attribute
from lightning_mgpu.parallel.tensor.multihead import STYLE, is_multihead_attention

_INPUT = "<block input>"
_ARGUMENT = "<argument {}>"  # another argument of the block's call: rotary frequencies, a mask, an encoder's output
_TRACE_SHAPE = (2, 4)  # (batch, sequence) of the fake hidden states
# A column-parallel projection whose output is split into equal parts: each part sharded alike (see apply.py).
_FUSED_STYLES = {3: "colwise_qkv", 2: "colwise_gate_up"}


def no_linear_layers(blocks_fqn: str) -> ValueError:
    return ValueError(
        f"tp_plan='auto' found no Linear layers to shard in the blocks {blocks_fqn!r}: tensor parallelism splits"
        " Linear layers, and a network of convolutions has none to split. Train it with data parallelism"
        " (zero_stage) or pipeline parallelism, or pass `tp_plan` as a dict {module_glob: style} or a callable"
        " (module, tp_mesh)."
    )


def derive_block_plan(module: nn.Module, blocks_fqn: str, example: ExampleStep | None = None) -> dict[str, str]:
    """``{glob over every block: style}`` for the blocks in ``blocks_fqn``, derived from block 0's data flow: in
    its call inside the user's step on one batch (``example``), or where that cannot run, on hidden states alone."""
    block_fqn = f"{blocks_fqn}.0"
    block = module.get_submodule(block_fqn)
    attentions = {name for name, child in block.named_modules() if name and is_multihead_attention(child)}
    projections = {
        name: child
        for name, child in block.named_modules()
        if name and is_projection(child) and not any(name.startswith(f"{a}.") for a in attentions)
    }
    if not projections and not attentions:
        raise no_linear_layers(blocks_fqn)
    units = {**projections, **{name: block.get_submodule(name) for name in attentions}}
    glob = {name: block_glob(f"{block_fqn}.{name}", blocks_fqn) for name in units}
    width = _stream_width(block, units)
    in_call = None
    if example is not None:
        try:
            flow, how = _trace_in_call(block, units, example), "the block's call inside the model's forward"
        except Exception as error:  # the step cannot run before training (manual optimization, no batch, ...)
            in_call = f"{type(error).__name__}: {error}"
    if example is None or in_call is not None:
        try:
            flow, how = _trace(block, units, width), f"a run on hidden states of width {width} alone"
        except Exception as error:  # the block needs more than hidden states (rotary cos/sin, a mask it cannot omit)
            guess = {glob[n]: _guess_by_shape(p, width) for n, p in projections.items()}
            guess.update({glob[n]: STYLE for n in attentions})
            raise ValueError(
                f"tp_plan='auto' cannot tell how to shard the layers of the blocks in {blocks_fqn!r}: their names are"
                f" not known, {_why_not_in_call(in_call)}, and running {block_fqn} ({type(block).__name__}) on hidden"
                f" states of width {width} alone failed ({type(error).__name__}: {error}). Pass `tp_plan` as a dict;"
                f" by shapes alone it would be tp_plan={guess!r} (choose where it says '|': 'colwise' reads the block"
                " input, 'rowwise' writes back into the residual stream, 'replicate' keeps a layer whole)."
            ) from error
    styles, unplaced = _classify(*flow, list(units), attentions, how)
    if unplaced:
        explicit = {glob[n]: styles.get(n, "replicate") for n in units}
        reasons = "; ".join(f"{block_fqn}.{n}: {why}" for n, why in unplaced.items())
        raise ValueError(
            f"tp_plan='auto' cannot tell how to shard these layers of the blocks in {blocks_fqn!r} from their data"
            f" flow in {how}: {reasons}. Pass `tp_plan` as a dict; this one keeps them whole (replicated) and shards"
            f" the rest as derived: tp_plan={explicit!r}"
        )
    plan = {glob[n]: s for n, s in styles.items()}
    rank_zero_info(
        "tp_plan='auto' derived this plan for the blocks in %r (%s) from their data flow in %s; pass it as"
        " `tp_plan` to pin it: %r",
        blocks_fqn,
        type(block).__name__,
        how,
        plan,
    )
    return plan


def _why_not_in_call(failure: str | None) -> str:
    if failure is None:
        return (
            "their real call inside the model's forward was not available (it is read from one batch of the fit's"
            " training data)"
        )
    return f"running the training step on one batch to read their real call failed ({failure})"


def _stream_width(block: nn.Module, units: dict[str, nn.Module]) -> int:
    """The residual stream's width: what the block's own norms normalize (not a per-head q/k norm deeper down),
    else the most common projection input."""
    for child in block.children():
        shape = getattr(child, "normalized_shape", None)
        if isinstance(shape, (tuple, list)) and len(shape) == 1:
            return int(shape[0])
    fan_in = lambda unit: unit.embed_dim if is_multihead_attention(unit) else projection_features(unit)[0]
    return Counter(fan_in(unit) for unit in units.values()).most_common(1)[0][0]


def _weights(units: dict[str, nn.Module]) -> dict[int, str]:
    """The weights by which an operation is recognised as a unit's: a projection's, or any of an
    ``nn.MultiheadAttention``'s (which runs as one call of ``F.multi_head_attention_forward``)."""
    weights = {}
    for name, unit in units.items():
        held = list(unit.parameters()) if is_multihead_attention(unit) else [unit.weight]
        weights.update({id(p): name for p in held})
    return weights


def _guess_by_shape(projection: nn.Module, width: int) -> str:
    fan_in, fan_out = projection_features(projection)
    if fan_in == width and fan_out != width:
        return "colwise"
    if fan_out == width and fan_in != width:
        return "rowwise"
    return "colwise | rowwise | replicate"


class _DataFlow(TorchFunctionMode):
    """Records, for every tensor made inside the block, which projections' outputs (or the block input) it derives
    from without passing another projection; and, for each projection, where its input came from."""

    def __init__(self, weights: dict[int, str]) -> None:
        super().__init__()
        self.weights = weights
        self.sources: dict[int, frozenset] = {}
        self.reads: dict[str, set] = {}
        self.outputs: dict[int, str] = {}  # a projection's own output tensor -> the projection
        self.chunks: dict[str, int] = {}  # a fused projection -> how many equal parts its output is split into
        self._alive: list[torch.Tensor] = []  # keeps traced tensors alive so that their ids stay theirs

    def mark(self, tensor: torch.Tensor, sources: frozenset) -> None:
        self.sources[id(tensor)] = self.sources.get(id(tensor), frozenset()) | sources
        self._alive.append(tensor)

    def mark_call(self, args: tuple, kwargs: dict) -> None:
        """The block's hidden-state input (its first argument) and its other arguments, each a source of its own."""
        named = [*enumerate(args), *kwargs.items()]
        for position, (key, value) in enumerate(named):
            source = _INPUT if position == 0 else _ARGUMENT.format(key)
            for tensor in (t for t in tree_flatten(value)[0] if isinstance(t, torch.Tensor)):
                self.mark(tensor, frozenset((source,)))

    def of(self, value: object) -> frozenset:
        tensors = [t for t in tree_flatten(value)[0] if isinstance(t, torch.Tensor)]
        return frozenset().union(*(self.sources.get(id(t), frozenset()) for t in tensors))

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        result = func(*args, **kwargs)
        arguments = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        projection = next((self.weights[id(t)] for t in arguments if id(t) in self.weights), None)
        came_from = self.of(arguments)
        if projection is not None:
            self.reads.setdefault(projection, set()).update(came_from)
            came_from = frozenset((projection,))
        elif args and id(args[0]) in self.outputs and _equal_parts_of_last_dim(args[0], result):
            self.chunks[self.outputs[id(args[0])]] = len(result)
        for tensor in tree_flatten(result)[0]:
            if isinstance(tensor, torch.Tensor):
                self.mark(tensor, came_from)
        return result

    def output_of(self, name: str) -> Callable[[nn.Module, tuple[object, ...], object], None]:
        """Forward hook (removed after the trace): what a projection module returns, e.g. after Conv1D's ``view``."""

        def hook(module: nn.Module, args: tuple[object, ...], output: object) -> None:
            if isinstance(output, torch.Tensor):
                self.outputs[id(output)] = name

        return hook


def _equal_parts_of_last_dim(tensor: object, result: object) -> bool:
    """Whether ``result`` is ``tensor`` cut into 2+ equal parts along its last dimension (a fused ``[q | k | v]``
    or ``[gate | up]`` split with ``split``/``chunk``)."""
    if not isinstance(tensor, torch.Tensor) or not isinstance(result, (tuple, list)) or len(result) < 2:
        return False
    shape = tuple(tensor.shape)
    parts = [tuple(part.shape) if isinstance(part, torch.Tensor) else None for part in result]
    return all(part == (*shape[:-1], shape[-1] // len(parts)) for part in parts) and shape[-1] % len(parts) == 0


def _trace(
    block: nn.Module, units: dict[str, nn.Module], width: int
) -> tuple[dict[str, set], frozenset, dict[str, int]]:
    """Run ``block`` on fake hidden states: each unit's input sources, the output's sources, and the fused
    projections with their number of parts."""
    weight = next(block.parameters())  # on the meta device for a model built there
    with fake_tensor_mode(allow_non_fake_inputs=True), torch.no_grad():
        hidden = torch.zeros(*_TRACE_SHAPE, width, dtype=weight.dtype, device=weight.device)
        return _traced(units, lambda: block(hidden), (hidden,), {})


def _trace_in_call(
    block: nn.Module, units: dict[str, nn.Module], example: ExampleStep
) -> tuple[dict[str, set], frozenset, dict[str, int]]:
    """Follow ``block``'s call inside the user's step on one batch (the step is ended right after the block)."""
    saved = instance_attribute(block, "forward")
    forward = block.forward
    traced: list[tuple[dict[str, set], frozenset, dict[str, int]]] = []

    def tracing(*args: object, **kwargs: object) -> NoReturn:
        traced.append(_traced(units, lambda: forward(*args, **kwargs), args, kwargs))
        raise _Traced

    object.__setattr__(block, "forward", tracing)  # the call's arguments after the block's own pre-hooks
    try:
        example.run()
    except _Traced:
        pass
    finally:
        restore_attribute(block, "forward", saved)
    if not traced:
        raise RuntimeError("the step returned without calling the block")
    return traced[0]


class _Traced(Exception):
    """Ends the user's step once the block's call was followed (raised through the user's code)."""


def _traced(
    units: dict[str, nn.Module], run: Callable[[], object], args: tuple, kwargs: dict
) -> tuple[dict[str, set], frozenset, dict[str, int]]:
    """``run()``, the block's call on ``args``/``kwargs``, followed by a ``_DataFlow``: each unit's input sources,
    the output's sources and the fused projections."""
    flow = _DataFlow(_weights(units))
    flow.mark_call(args, kwargs)
    handles = [p.register_forward_hook(flow.output_of(name)) for name, p in units.items()]
    try:
        with flow:
            output = run()
    finally:
        for handle in handles:
            handle.remove()
    first = next((t for t in tree_flatten(output)[0] if isinstance(t, torch.Tensor)), None)
    if first is None:
        raise TypeError(f"the block returned no tensor ({type(output).__name__})")
    return flow.reads, flow.of(first), flow.chunks


def _classify(
    reads: dict[str, set], output: frozenset, fused: dict[str, int], names: list[str], attentions: set[str], how: str
) -> tuple[dict[str, str], dict[str, str]]:
    """Megatron's split from the data flow: ``({unit: style}, {unit: why it has none})``.

    The block's other arguments (rotary frequencies, masks, an encoder's output) are replicated inputs: a
    column-parallel projection may read them besides the stream (cross-attention's keys and values), and a
    row-parallel one's input may mix them in (a position bias added to the scores). An ``nn.MultiheadAttention``
    is sharded whole, by heads, whatever it reads; its output is one more writer into the stream."""
    sides = {source for came_from in reads.values() for source in came_from if source.startswith(_ARGUMENT[:10])}
    writers = {n for n in output if not n.startswith("<")}
    stream = writers | {_INPUT}
    readers = {
        n
        for n, came_from in reads.items()
        if came_from and came_from <= stream | sides and n not in writers and n not in attentions
    }
    own = {n: reads[n] - sides for n in writers if n not in attentions and n in reads}  # inputs that are no argument
    rowwise = {n for n, came_from in own.items() if came_from and came_from <= readers}
    feeding = {source for n in rowwise for source in reads[n]}
    styles: dict[str, str] = {}
    unplaced: dict[str, str] = {}
    for name in names:
        if name not in reads:
            unplaced[name] = f"not reached in {how}"
        elif name in attentions:
            styles[name] = STYLE
        elif name in rowwise:
            styles[name] = "rowwise"
        elif name in readers and name in feeding:
            styles[name] = _FUSED_STYLES.get(fused.get(name, 1), "colwise")
        elif name in readers:
            unplaced[name] = "reads the residual stream, but no row-parallel projection reads its output"
        elif name in writers:
            unplaced[name] = (
                f"writes into the residual stream, but reads more than column-parallel outputs ({sorted(reads[name])})"
            )
        else:
            unplaced[name] = f"sits between other projections (reads {sorted(reads[name])})"
    return styles, unplaced
