"""A planned layout as the user writes it, and checked as the strategy checks it.

:func:`refusal` runs ``HybridStrategy``'s own checks on a planned layout for the model: those it runs when the
Trainer is built (options, sizes, precision, the global batch) and those its setup runs on the module, here on the
model's shapes (the sharded sizes tensor parallelism needs divisible, a block per pipeline stage, the sequence split
in two chunks per context-parallel rank, the expert counts); it returns the strategy's own message, so that the
planner ranks only what the strategy runs and says why it will not in the strategy's words. :func:`strategy_call`
and :func:`cli_yaml` write the winner as the ``HybridStrategy(...)`` call and the LightningCLI block to paste, with
every setting the prediction assumes.
"""

from __future__ import annotations

import functools
import json
from typing import Any

from lightning_mgpu.layout import ParallelLayout, layout_warnings
from lightning_mgpu.layout_checks import accumulation_for, check_options, check_sizes
from lightning_mgpu.options import ParallelOptions
from lightning_mgpu.parallel import context, experts, pipeline, tensor
from lightning_mgpu.planner.cluster import ClusterSpec
from lightning_mgpu.planner.job import Layout, Training
from lightning_mgpu.planner.model_spec import ModelSpec


def strategy_kwargs(layout: Layout, training: Training) -> dict[str, Any]:
    """``HybridStrategy``'s arguments for ``layout``, with the global batch the prediction is for."""
    return layout.strategy_arguments() | {"global_batch_size": training.global_batch}


def trainer_kwargs(layout: Layout, cluster: ClusterSpec, training: Training) -> dict[str, Any]:
    """The ``Trainer`` arguments the layout runs with: devices per node, nodes, precision."""
    return {
        "accelerator": "cpu" if cluster.name == "cpu" else "gpu",
        "devices": layout.world_size // cluster.nodes,
        "num_nodes": cluster.nodes,
        "precision": training.precision,
    }


def refusal(model: ModelSpec, layout: Layout, training: Training) -> str | None:
    """What ``HybridStrategy`` refuses about ``layout`` for ``model``, in its words; None when it runs it."""
    try:
        check_with_strategy(model, layout, training)
    except (ValueError, NotImplementedError) as error:
        return str(error)
    return None


def check_with_strategy(model: ModelSpec, layout: Layout, training: Training) -> None:
    """Raise what ``HybridStrategy`` raises for this layout and model (see the module docstring)."""
    refused = _arguments_refusal(tuple(sorted(strategy_kwargs(layout, training).items())), training.precision)
    if refused is not None:
        raise refused[0](refused[1])
    _check_model(model, layout)
    accumulation_for(training.global_batch, layout.loader_batch_size, layout.dp, 1)


def warnings_for(layout: Layout, cluster: ClusterSpec) -> list[str]:
    """What the strategy would warn about the layout on this cluster (it runs it)."""
    return layout_warnings(strategy_layout(layout), layout.world_size // cluster.nodes, cluster.nodes)


def strategy_layout(layout: Layout) -> ParallelLayout:
    """The strategy's layout for the planner's (described as the strategy says it): the sizes its arguments give."""
    arguments = layout.strategy_arguments()
    ep, shard = arguments.get("expert_parallel_size", 1), arguments.get("data_parallel_shard_size")
    return ParallelLayout(layout.dp, layout.tp, layout.pp, layout.zero_stage, layout.cp, ep, shard)


@functools.lru_cache(maxsize=4096)  # the search asks for the same arguments across microbatch sizes
def _arguments_refusal(arguments: tuple[tuple[str, Any], ...], precision: str) -> tuple[type, str] | None:
    """The error type and message of :func:`_check_arguments`, or None (remembered either way)."""
    try:
        _check_arguments(dict(arguments), precision)
    except (ValueError, NotImplementedError) as error:
        return type(error), str(error)
    return None


def _check_arguments(kwargs: dict[str, Any], precision: str) -> None:
    """The strategy's checks when it is constructed and when the Trainer is built, without building either."""
    sizes = {name: kwargs.pop(name) for name in _SIZES if name in kwargs}
    dp, tp, pp, zero = (sizes.get(name, 1) for name in _SIZES[:4])
    cp = sizes.get("context_parallel_size", 1)
    ep, shard = sizes.get("expert_parallel_size", 1), sizes.get("data_parallel_shard_size")
    layout = ParallelLayout.resolve(dp * tp * pp * cp, dp, tp, pp, zero, cp, ep, shard)
    options = ParallelOptions(**kwargs)
    check_options(options, zero, tp, pp, cp)
    check_sizes(options, precision, (dp, tp, pp, zero), layout)


_SIZES = (
    "data_parallel_size",
    "tensor_parallel_size",
    "pipeline_parallel_size",
    "zero_stage",
    "context_parallel_size",
    "expert_parallel_size",
    "data_parallel_shard_size",
)


def _check_model(model: ModelSpec, layout: Layout) -> None:
    """The checks setup runs on the module, on the model's shapes."""
    if layout.tp > 1:
        tensor.check_sharded_sizes(sharded_sizes(model, layout), layout.tp)
    if layout.pp > 1:
        pipeline.check_stage_count(layout.pp * layout.stages_per_rank, model.layers, f"{model.name}'s blocks")
    if layout.cp > 1:
        context.check_sequence_length(model.seq_len, layout.cp)
    if layout.ep > 1:
        experts.check_expert_counts({"every block": model.experts} if model.experts else {}, layout.ep, model.name)


def sharded_sizes(model: ModelSpec, layout: Layout) -> dict[str, int]:
    """The sizes the library's tensor plans shard, named as the strategy names them (``{}``: the size)."""
    sizes = {  # heads as the strategy names a Hugging Face config's (``parallel.tensor.checks``)
        "the model's config.num_attention_heads = {}": model.heads,
        "the model's config.num_key_value_heads = {}": model.num_kv_heads,
        "the model's hidden_size = {}": model.hidden,
    }
    if not (model.experts and layout.ep > 1):  # experts split by expert under ep, by tensor parallelism without
        sizes["the MLP's intermediate_size = {}"] = model.expert_ffn
    if layout.options.sequence_parallel or model.vocab_parallel:  # the embedding and the head split over the vocabulary
        sizes["the model's vocab_size = {}"] = model.vocab
    return sizes


# ------------------------------------------------------------------------------------------------- what to paste
def strategy_call(layout: Layout, training: Training) -> str:
    """``HybridStrategy(...)`` for the layout, one argument a line."""
    lines = [f"    {name}={_python(value)}," for name, value in strategy_kwargs(layout, training).items()]
    return "HybridStrategy(\n" + "\n".join(lines) + "\n)"


def python_recipe(layout: Layout, cluster: ClusterSpec, training: Training) -> str:
    """The Trainer with the strategy, ready to paste, and the DataLoader batch size it expects."""
    trainer = ", ".join(f"{name}={_python(value)}" for name, value in trainer_kwargs(layout, cluster, training).items())
    return (
        "import lightning as L\nfrom lightning_mgpu import HybridStrategy\n\n"
        f"strategy = {strategy_call(layout, training)}\n"
        f"trainer = L.Trainer({trainer}, strategy=strategy)\n"
        f"# DataLoader(batch_size={layout.loader_batch_size}) per data-parallel rank:"
        f" {layout.dp} ranks x {layout.loader_batch_size} x {_accumulation(layout, training)} accumulated ="
        f" {training.global_batch} sequences per step"
    )


def cli_yaml(layout: Layout, cluster: ClusterSpec, training: Training) -> str:
    """The LightningCLI ``trainer:`` block for the layout."""
    lines = ["trainer:"]
    lines += [f"  {name}: {_yaml(value)}" for name, value in trainer_kwargs(layout, cluster, training).items()]
    lines += ["  strategy:", "    class_path: lightning_mgpu.HybridStrategy", "    init_args:"]
    lines += [f"      {name}: {_yaml(value)}" for name, value in strategy_kwargs(layout, training).items()]
    lines += ["data:", f"  batch_size: {layout.loader_batch_size}  # per data-parallel rank (your DataModule's name)"]
    return "\n".join(lines)


def _accumulation(layout: Layout, training: Training) -> int:
    return training.global_batch // (layout.dp * layout.loader_batch_size)


def _python(value: object) -> str:
    """A literal as the docs write them (double-quoted strings)."""
    return json.dumps(value) if isinstance(value, str) else repr(value)


def _yaml(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)
