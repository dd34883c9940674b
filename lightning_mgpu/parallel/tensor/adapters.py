"""LoRA adapters (``peft``) under tensor parallelism: each adapter split to match the projection it sits beside.

A LoRA layer replaces a projection by a module holding the projection (``base_layer``) and, per adapter name, a
down projection ``lora_A`` (in -> r) and an up projection ``lora_B`` (r -> out); its forward returns
``base_layer(x) + lora_B(lora_A(dropout(x))) * scaling``. The sum needs both terms in one layout, which is
Megatron's split of a low-rank pair:

- beside a column-parallel projection (output features sharded), ``lora_A`` stays whole on every rank and
  ``lora_B`` is column-parallel with the projection's own style (a fused ``[q | k | v]`` chunk by chunk);
- beside a row-parallel projection (input features sharded), ``lora_A`` is row-parallel with the projection's
  style (its rank-r output all-reduced) and ``lora_B`` stays whole.

Both are exact: the gradients equal one process's, and the whole adapter's gradient is the same on every rank.
The plan names the LoRA layer (a Hugging Face plan's ``q_proj``) or its projection (``q_proj.base_layer``); the
adapters' own entries, which a plan derived from the module's Linears may hold, are replaced by these.
"""

from __future__ import annotations

from torch import nn

# Styles whose output features are sharded: the up projection takes the same; and those whose input features are.
_COLUMN_STYLES = ("colwise", "colwise_qkv", "colwise_gate_up", "colwise_gather_output")
_ROW_STYLES = ("rowwise", "rowwise_split_input")
_ADAPTER_DICTS = ("lora_A", "lora_B", "lora_embedding_A", "lora_embedding_B", "lora_magnitude_vector")


def lora_layers(module: nn.Module) -> list[str]:
    """Names of the ``peft`` LoRA layers in ``module`` (a ``base_layer`` beside ``lora_A``/``lora_B``)."""
    return [name for name, sub in module.named_modules() if _is_lora_layer(sub)]


def _is_lora_layer(sub: nn.Module) -> bool:
    return isinstance(getattr(sub, "base_layer", None), nn.Module) and isinstance(
        getattr(sub, "lora_A", None), nn.ModuleDict
    )


def through_adapters(module: nn.Module, matched: dict[str, str]) -> dict[str, str]:
    """``matched`` (module name -> style name) with each LoRA layer's entry moved to its projection and its
    adapters split to match (see the module's docstring). A style no adapter split is known for is refused."""
    layers = lora_layers(module)
    if not layers:
        return matched
    result = dict(matched)
    for name in layers:
        adapters = [f"{name}.{d}" for d in _ADAPTER_DICTS]
        for key in [k for k in result if any(k == a or k.startswith(f"{a}.") for a in adapters)]:
            del result[key]  # a derived plan's guess at the adapters' own Linears
        base = f"{name}.base_layer"
        style_name = result.pop(name, None) or result.get(base)
        if style_name is None:
            continue  # the projection is not split: neither are its adapters
        layer = module.get_submodule(name)
        _check_adapter_kinds(name, layer, style_name)
        result[base] = style_name
        if style_name in _COLUMN_STYLES:
            result.update({f"{name}.lora_B.{a}": style_name for a in _adapter_names(layer, "lora_B")})
        elif style_name in _ROW_STYLES:
            result.update({f"{name}.lora_A.{a}": style_name for a in _adapter_names(layer, "lora_A")})
        else:
            raise NotImplementedError(
                f"LoRA adapters on {name!r}, which the tensor-parallel plan gives {style_name!r}: adapters are split"
                f" beside column-parallel ({', '.join(_COLUMN_STYLES)}) and row-parallel ({', '.join(_ROW_STYLES)})"
                f" projections only. Leave {name!r} out of LoRA's target_modules, give it one of those styles in"
                " `tp_plan`, or train the adapters with data parallelism."
            )
    return result


def adapter_projections(module: nn.Module, matched: dict[str, str]) -> set[str]:
    """The entries of ``matched`` that are adapters (``<layer>.lora_A.<name>``, ``<layer>.lora_B.<name>``): their
    rank-r side is the adapter's bottleneck, never an attention's heads, whatever its width."""
    layers = set(lora_layers(module))
    return {n for n in matched if n.count(".") >= 2 and _adapter_of(n) in layers}


def _adapter_of(name: str) -> str | None:
    """The LoRA layer ``<layer>.lora_A.<adapter>`` (or ``lora_B``) names, else None."""
    layer, dict_name, _ = name.rsplit(".", 2)
    return layer if dict_name in ("lora_A", "lora_B") else None


def _adapter_names(layer: nn.Module, dict_name: str) -> list[str]:
    adapters = getattr(layer, dict_name)
    assert isinstance(adapters, nn.ModuleDict)
    return list(adapters.keys())


def _check_adapter_kinds(name: str, layer: nn.Module, style_name: str) -> None:
    """Only Linear adapters on a Linear-like projection are split here (not DoRA's magnitude, not embeddings)."""
    magnitude = getattr(layer, "lora_magnitude_vector", None)
    embedding = getattr(layer, "lora_embedding_A", None)
    dora = isinstance(magnitude, nn.ModuleDict) and len(magnitude) > 0
    if dora or (isinstance(embedding, nn.ParameterDict) and len(embedding) > 0):
        raise NotImplementedError(
            f"{name!r} ({type(layer).__name__}, style {style_name!r}) holds DoRA magnitudes or embedding adapters,"
            " which tensor parallelism does not split. Use plain LoRA (use_dora=False) on Linear projections, or"
            " train the adapters with data parallelism."
        )
    for dict_name in ("lora_A", "lora_B"):
        for adapter_name, adapter in getattr(layer, dict_name).items():
            if not isinstance(adapter, nn.Linear):
                raise NotImplementedError(
                    f"{name}.{dict_name}.{adapter_name} is a {type(adapter).__name__}; tensor parallelism splits"
                    " Linear adapters only. Train these adapters with data parallelism."
                )
