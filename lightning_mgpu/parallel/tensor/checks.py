"""What a tensor-parallel plan needs of the model, checked before training: sharded sizes divisible by the degree
(naming each size and the valid degrees) and fused projections whose chunks can be sharded alike."""

from __future__ import annotations

import math
import re
from collections import Counter
from collections.abc import Iterable

from torch import nn

from lightning_mgpu.parallel.blocks import is_projection, projection_features

# Attributes an attention module keeps about its global size: checked against the degree before training.
_HEAD_COUNT_ATTRIBUTES = (
    "n_head",
    "n_heads",
    "num_heads",
    "num_attention_heads",
    "num_key_value_heads",
    "n_kv_heads",
    "n_query_groups",
    "n_embd",
    "embed_dim",
    "split_size",
    "all_head_size",
)


def check_divisible(module: nn.Module, matched: dict[str, str], tp: int) -> None:
    _check_fused_chunks(module, matched)  # first: a fused projection's chunk size means nothing where they differ
    sizes: dict[str, int] = {}  # what each sharded size is, by the words naming it
    for name, style_name in matched.items():
        child = module.get_submodule(name)
        if style_name.startswith("colwise") and is_projection(child):
            chunks = {"colwise_qkv": 3, "colwise_gate_up": 2}.get(style_name, 1)
            per = {3: " per q/k/v", 2: " per gate/up"}.get(chunks, "")
            sizes[f"{name}: {{}} output features{per}"] = projection_features(child)[1] // chunks
        elif style_name.startswith("rowwise") and is_projection(child):
            sizes[f"{name}: {{}} input features"] = projection_features(child)[0]
        elif style_name == "multihead_attention" and isinstance(child, nn.MultiheadAttention):
            sizes[f"{name}.num_heads = {{}}"] = child.num_heads
        elif style_name.startswith("embedding") and isinstance(child, nn.Embedding):
            row = style_name == "embedding_rowwise"
            sizes[f"{name}: {{}} {'vocabulary entries' if row else 'channels'}"] = (
                child.num_embeddings if row else child.embedding_dim
            )
    for name, attention in _attention_modules(module, matched):
        for attribute in _HEAD_COUNT_ATTRIBUTES:
            value = getattr(attention, attribute, None)
            if isinstance(value, int) and not isinstance(value, bool):
                sizes[f"{name}.{attribute} = {{}}"] = value
        for attribute in ("num_attention_heads", "num_key_value_heads"):
            value = _config_value(attention, attribute)
            if isinstance(value, int) and not isinstance(value, bool):
                sizes[f"the model's config.{attribute} = {value}"] = value  # once, not per module holding it
    check_sharded_sizes(sizes, tp)


def check_sharded_sizes(sizes: dict[str, int], tp: int) -> None:
    """Every size a plan shards (``{"what: {} output features": 4096}``, the ``{}`` standing for the size) divisible
    by ``tp``, else raise naming each that is not and the degrees that would do. The planner checks a model's
    shapes with it, so that it refuses what training would, in the same words."""
    problems = _by_block_glob(text.format(size) for text, size in sizes.items() if size % tp)
    if problems:
        common = math.gcd(*sizes.values())
        valid = [d for d in range(2, common + 1) if common % d == 0]
        raise ValueError(
            f"tensor_parallel_size={tp} must divide every sharded size, but: {'; '.join(problems)}."
            f" Valid tensor_parallel_size values for this model and plan: {valid or 'none above 1'}"
            " (the divisors of the heads, key/value heads, hidden and vocabulary sizes it shards)."
        )


def _by_block_glob(problems: Iterable[str]) -> list[str]:
    """One entry per problem of every block (``layers.*.self_attn: ... (80 blocks)``), not one per layer: an
    80-layer model's message names the size once."""
    counts = Counter(re.sub(r"\.\d+(?=[.:])", ".*", problem) for problem in problems)
    return [problem + (f" ({count} blocks)" if count > 1 else "") for problem, count in sorted(counts.items())]


_QUERY_HEADS = ("n_head", "n_heads", "num_heads", "num_attention_heads")
_KEY_VALUE_HEADS = ("n_query_groups", "num_key_value_heads", "n_kv_heads", "num_kv_heads")


def _head_count(attention: nn.Module, names: tuple[str, ...]) -> int | None:
    for name in names:
        value = getattr(attention, name, None)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    for name in names:
        value = _config_value(attention, name)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return None


def _config_value(attention: nn.Module, name: str) -> object:
    """``attention.config.<name>``; for a configuration whose layers differ (transformers' per-layer configs refuse
    a global read of such a value), the value of this attention's own layer."""
    config = getattr(attention, "config", None)
    try:
        return getattr(config, name, None)
    except RuntimeError:  # transformers' AmbiguousGlobalPerLayerAttributeError
        layer = getattr(attention, "layer_idx", None)
        per_layer = getattr(config, "per_layer_config", None)
        return getattr(per_layer[layer], name, None) if per_layer is not None and isinstance(layer, int) else None


def fused_chunks_differ(module: nn.Module, name: str) -> bool:
    """Whether the fused projection ``name`` holds q, k and v of grouped-query attention (chunks of unequal size)."""
    heads, groups = _heads_and_groups(module, name)
    return heads is not None and groups is not None and groups != heads


def _heads_and_groups(module: nn.Module, name: str) -> tuple[int | None, int | None]:
    """Query and key/value head counts of the attention holding the projection ``name``."""
    if "." not in name:
        return None, None
    attention = module.get_submodule(parent_name(name))
    return _head_count(attention, _QUERY_HEADS), _head_count(attention, _KEY_VALUE_HEADS)


def _check_fused_chunks(module: nn.Module, matched: dict[str, str]) -> None:
    """'colwise_qkv' shards three equal chunks [q | k | v]; grouped-query attention fuses chunks of other sizes."""
    for name, style_name in matched.items():
        if style_name != "colwise_qkv" or "." not in name:
            continue
        attention_name = parent_name(name)
        heads, groups = _heads_and_groups(module, name)
        if fused_chunks_differ(module, name):
            raise ValueError(
                f"{name} fuses q, k and v of grouped-query attention ({heads} query heads, {groups} key/value heads"
                f" in {attention_name}): its chunks differ in size, and 'colwise_qkv' shards three equal chunks."
                " Fused grouped-query projections cannot be tensor-parallel yet; keep that attention whole with"
                f" tp_plan entries {{{_glob_hint(name)!r}: 'replicate',"
                f" {_glob_hint(_sibling_rowwise(matched, name))!r}: 'replicate'}} (the MLP stays sharded), or use"
                " separate q/k/v projections."
            )


def _sibling_rowwise(matched: dict[str, str], name: str) -> str:
    parent = parent_name(name)
    return next(
        (n for n, s in matched.items() if s == "rowwise" and parent_name(n) == parent), parent + ".<out projection>"
    )


def _glob_hint(name: str) -> str:
    """``model.transformer.h.3.attn.qkv`` -> ``model.transformer.h.*.attn.qkv`` (the glob for every block)."""
    parts = name.split(".")
    return ".".join("*" if part.isdigit() else part for part in parts)


def _attention_modules(module: nn.Module, matched: dict[str, str]) -> list[tuple[str, nn.Module]]:
    """Parents of column-sharded projections inside blocks: the modules that split outputs into heads."""
    parents = {name.rsplit(".", 1)[0] for name, s in matched.items() if s in ("colwise", "colwise_qkv") and "." in name}
    return [(p, module.get_submodule(p)) for p in sorted(parents)]


def parent_name(fqn: str) -> str:
    """``a.b.c`` -> ``a.b``; ``""`` for a top-level name."""
    return fqn.rsplit(".", 1)[0] if "." in fqn else ""
