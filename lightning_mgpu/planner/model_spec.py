"""What the planner needs to know about a model: its shapes, parameter counts and FLOPs per token.

A :class:`ModelSpec` comes from flags (``--layers --hidden ...``) or from a real module built on the meta device
(:func:`spec_from_module`), so no weights are allocated however large the model is.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import json
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from torch import nn

from lightning_mgpu.extras import EXTRAS, install_hint


@dataclass(frozen=True)
class ModelSpec:
    """A decoder-only transformer: ``layers`` blocks of attention + MLP, token embedding and an output head.

    Parameter counts default to the usual formulas; :func:`spec_from_module` fills them from a real module.
    ``block_params`` counts one block; ``embed_params`` what lives on the first pipeline stage besides blocks;
    ``head_params`` what lives on the last (final norm and an untied head; a tied head is the embedding).
    Mixture-of-experts blocks: ``expert_params`` counts one block's routed experts (all ``experts`` of them, part of
    ``block_params``; both are means over the blocks, as some models keep dense blocks between MoE ones), of which
    ``experts_per_token`` run per token.
    """

    layers: int
    hidden: int
    heads: int
    vocab: int
    seq_len: int
    kv_heads: int | None = None
    ffn_hidden: int | None = None
    gated_mlp: bool = False
    tied_embeddings: bool = False
    learned_positions: bool = False
    block_params: int | None = None
    embed_params: int | None = None
    head_params: int | None = None
    # The library's tensor plan shards the token embedding and the head over the vocabulary even without sequence
    # parallelism: Hugging Face models' own plans do (an untied head); this library's plans only with it.
    vocab_parallel: bool = False
    experts: int = 0
    experts_per_token: int | None = None
    expert_params: int = 0
    fused_experts: bool = False  # one [experts, ...] weight per projection (Hugging Face), not a list of modules
    name: str = "model"
    notes: tuple[str, ...] = field(default=(), compare=False)

    def __post_init__(self) -> None:
        for name in ("layers", "hidden", "heads", "vocab", "seq_len"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"The model's `{name}` must be a positive integer, got {value!r}.")
        if self.hidden % self.heads:
            raise ValueError(f"hidden={self.hidden} is not divisible by heads={self.heads}: fix --hidden or --heads.")
        if self.heads % self.num_kv_heads:
            raise ValueError(f"heads={self.heads} is not divisible by kv_heads={self.num_kv_heads}: fix --kv-heads.")

    @property
    def num_kv_heads(self) -> int:
        return self.kv_heads or self.heads

    @property
    def ffn(self) -> int:
        return self.ffn_hidden or 4 * self.hidden

    @property
    def kv_dim(self) -> int:
        return self.num_kv_heads * (self.hidden // self.heads)

    @property
    def expert_ffn(self) -> int:
        """One routed expert's MLP width (the MLP width for a dense model)."""
        if not (self.expert_params and self.experts):
            return self.ffn
        return max(1, round(self.expert_params / self.experts / (3 if self.gated_mlp else 2) / self.hidden))

    def routed_flops_per_token(self) -> float:
        """Forward FLOPs per token of one block's routed experts (the experts it is sent to); 0 for a dense model."""
        if not (self.expert_params and self.experts):
            return 0.0
        return 2.0 * (self.experts_per_token or 1) * self.expert_params / self.experts

    @property
    def attention_params_per_layer(self) -> int:
        h = self.hidden
        return 2 * h * h + 2 * h * self.kv_dim

    @property
    def dense_matmul_params_per_layer(self) -> int:
        """The weights tensor parallelism splits outside the routed experts: q, k, v, o, and a dense block's MLP."""
        mlp = 0 if self.expert_params else (3 if self.gated_mlp else 2) * self.hidden * self.ffn
        return self.attention_params_per_layer + mlp

    @property
    def matmul_params_per_layer(self) -> int:
        """Weights one token multiplies with (q, k, v, o and the MLP, or the experts it is routed to); norms, biases
        and routers left out."""
        if self.expert_params and self.experts:
            one_expert = self.expert_params / self.experts
            return self.attention_params_per_layer + round((self.experts_per_token or 1) * one_expert)
        return self.dense_matmul_params_per_layer

    @property
    def params_per_layer(self) -> int:
        if self.block_params is not None:
            return self.block_params
        return self.dense_matmul_params_per_layer + self.expert_params + 4 * self.hidden

    @property
    def first_stage_params(self) -> int:
        if self.embed_params is not None:
            return self.embed_params
        return self.vocab * self.hidden + (self.seq_len * self.hidden if self.learned_positions else 0)

    @property
    def last_stage_params(self) -> int:
        if self.head_params is not None:
            return self.head_params
        return (0 if self.tied_embeddings else self.vocab * self.hidden) + 2 * self.hidden

    @property
    def total_params(self) -> int:
        return self.layers * self.params_per_layer + self.first_stage_params + self.last_stage_params

    def forward_flops_per_token(self) -> tuple[float, float]:
        """Forward FLOPs per token of one block and of the output head (Narayanan et al. 2021 count).

        A block: 2 FLOPs per matmul weight plus ``4 * seq * hidden`` for the attention scores and their product with
        the values (the full square, as the paper counts). The head: ``2 * hidden * vocab``.
        """
        block = 2.0 * self.matmul_params_per_layer + 4.0 * self.seq_len * self.hidden
        return block, 2.0 * self.hidden * self.vocab

    def describe(self) -> str:
        kv = f" kv_heads={self.num_kv_heads}" if self.num_kv_heads != self.heads else ""
        n = self.total_params
        size = f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.2f}M"
        return (
            f"{self.name}: {size} params, layers={self.layers} hidden={self.hidden}"
            f" heads={self.heads}{kv} ffn={self.ffn} vocab={self.vocab} seq={self.seq_len}"
        )


# Config attribute names, most specific first: Hugging Face, nanoGPT / litgpt, Megatron-style.
_FIELDS = {
    "layers": ("num_hidden_layers", "n_layer", "num_layers", "n_layers"),
    "hidden": ("hidden_size", "n_embd", "d_model", "dim"),
    "heads": ("num_attention_heads", "n_head", "n_heads", "num_heads"),
    "kv_heads": ("num_key_value_heads", "n_query_groups", "n_kv_heads", "num_kv_heads"),
    "ffn_hidden": ("intermediate_size", "ffn_hidden_size", "intermediate_dim", "n_inner"),
    "vocab": ("vocab_size", "padded_vocab_size", "n_vocab"),
    "seq_len": ("max_position_embeddings", "block_size", "n_positions", "max_seq_len", "seq_len"),
    "experts_per_token": ("num_experts_per_tok", "moe_top_k", "top_k", "n_activated_experts"),
}


def load_class(path: str, flag: str = "--module") -> type:
    """``pkg.mod:Class`` (or ``pkg.mod.Class``) to the class, with an error that names what was not found and the
    fix: a module named without its class, a missing optional package (with the extra installing it), a name that
    is not a class."""
    module_name, _, attr = path.partition(":") if ":" in path else path.rpartition(".")
    if not module_name or not attr:
        raise ValueError(f"{flag} {path!r} must look like 'package.module:ClassName'.")
    if ":" not in path and _importable(path):  # `pkg.mod`: a module, its class not named
        raise ValueError(f"{flag} {path!r} names a module: add the class, {path + ':ClassName'!r}.")
    try:
        module = importlib.import_module(module_name)
    except ImportError as error:
        missing = getattr(error, "name", None)
        if missing in EXTRAS:
            raise ValueError(
                f"{flag} {path!r}: {module_name!r} needs the {missing!r} package, which is not installed:"
                f" {install_hint(missing)}."
            ) from error
        raise ValueError(f"{flag} {path!r}: cannot import {module_name!r} ({error}).") from error
    if not hasattr(module, attr):
        classes = sorted(n for n, v in vars(module).items() if isinstance(v, type) and not n.startswith("_"))
        listed = f" Its classes: {', '.join(classes[:12])}." if classes else ""
        raise ValueError(f"{flag} {path!r}: {module_name!r} has no attribute {attr!r}.{listed}")
    found = getattr(module, attr)
    if not isinstance(found, type):
        raise ValueError(f"{flag} {path!r} is a {type(found).__name__}, not a class: name a LightningModule class.")
    return found


def _importable(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):  # a parent that is not a package
        return False


def check_arguments(cls: type, init_args: Mapping[str, object], flag: str = "--init-args") -> None:
    """An argument ``cls`` does not take, or one it needs and lacks, named with the flag that gave them."""
    try:
        signature = inspect.signature(cls)
    except (TypeError, ValueError):  # a class without a readable signature: its own call says what is wrong
        return
    try:
        signature.bind(**init_args)
    except TypeError as error:
        takes = ", ".join(p for p in signature.parameters if p not in ("args", "kwargs")) or "nothing"
        raise ValueError(
            f"{flag} {json.dumps(init_args)}: {cls.__name__} {error}. {cls.__name__} takes: {takes}."
        ) from None


def instantiate(cls: type, init_args: Mapping[str, object], flag: str = "--init-args") -> Any:
    """``cls(**init_args)``; arguments it does not take or lacks, or values it refuses, named with the flag that
    gave them (the class's own message kept)."""
    check_arguments(cls, init_args, flag)
    try:
        return cls(**init_args)
    except (TypeError, ValueError, AttributeError, KeyError, AssertionError) as error:
        raise ValueError(
            f"{flag} {json.dumps(init_args)}: {cls.__name__}(...) refused them ({type(error).__name__}: {error})."
            " Check each value's type and range."
        ) from error


def build_on_meta(cls: type, init_args: Mapping[str, object] | None = None) -> nn.Module:
    """Instantiate ``cls(**init_args)`` on the meta device (no memory), running ``configure_model`` if it has one."""
    import torch

    with torch.device("meta"):
        module = instantiate(cls, init_args or {})
        if hasattr(module, "configure_model"):
            module.configure_model()
    if not isinstance(module, nn.Module):
        raise ValueError(f"{cls.__name__}(...) built a {type(module).__name__}, not a torch.nn.Module.")
    return module


def spec_from_module(module: nn.Module, seq_len: int | None = None, **overrides: Any) -> ModelSpec:
    """Read a module's shapes from its config attributes and its parameter counts from its blocks.

    ``overrides`` (e.g. ``heads=...``) win over what is read; a shape neither read nor given is an error that names
    the flag to pass.
    """
    from lightning_mgpu.parallel.blocks import block_at, find_block_container, tied_parameters

    found = find_block_container(module)
    if found is None:
        raise ValueError(
            f"{type(module).__name__} has no list of repeated blocks: the planner models transformers."
            " Describe it with --layers/--hidden/--heads/--vocab instead."
        )
    container_name, blocks = found
    values: dict[str, Any] = {"layers": len(blocks)}
    for config in _configs(module):
        for key, names in _FIELDS.items():
            if key not in values:
                value = next((getattr(config, n) for n in names if isinstance(getattr(config, n, None), int)), None)
                if value is not None and not isinstance(value, bool):
                    values[key] = value
    embeddings = [m for m in module.modules() if isinstance(m, nn.Embedding)]
    if "hidden" not in values and embeddings:
        values["hidden"] = max(embeddings, key=lambda m: m.num_embeddings).embedding_dim
    if "vocab" not in values and embeddings:
        values["vocab"] = max(m.num_embeddings for m in embeddings)
    if seq_len is not None:
        values["seq_len"] = seq_len
    values |= _routed_experts(blocks, len(blocks))
    values.update({k: v for k, v in overrides.items() if v is not None})
    missing = [k for k in ("hidden", "heads", "vocab", "seq_len") if k not in values]
    if missing:
        flags = " ".join(f"--{k.replace('_', '-')} N" for k in missing)
        raise ValueError(f"Could not read {', '.join(missing)} from {type(module).__name__}: pass {flags}.")
    block_params = sum(p.numel() for p in block_at(blocks, 0).parameters())
    if values.get("expert_params"):  # MoE: dense and MoE blocks may alternate, so the mean block
        block_params = round(sum(p.numel() for p in blocks.parameters()) / len(blocks))
    in_blocks = {id(p) for p in blocks.parameters()}
    embed_ids = {id(p) for m in embeddings for p in m.parameters()}
    seen: set[int] = set()
    first = last = 0
    for param in module.parameters():  # unique parameters: a tied weight is counted once
        if id(param) in in_blocks or id(param) in seen:
            continue
        seen.add(id(param))
        if id(param) in embed_ids:
            first += param.numel()
        else:
            last += param.numel()
    tied = bool(tied_parameters(module))  # a tied head's copy on the last stage is added per layout (cost.py)
    gated_names = ("gate_proj", "gate_up_proj", "w3", "fc_1")
    gated = any(hasattr(m, name) for m in block_at(blocks, 0).modules() for name in gated_names)
    notes = (f"blocks: {container_name} ({len(blocks)} x {block_params:,} params)",)
    hugging_face = any(getattr(getattr(m, "config", None), "base_model_tp_plan", None) for m in module.modules())
    return ModelSpec(
        name=type(module).__name__,
        tied_embeddings=tied,
        vocab_parallel=hugging_face and not tied,
        gated_mlp=gated,
        block_params=block_params,
        embed_params=first,
        head_params=last,
        notes=notes,
        **values,
    )


def _routed_experts(blocks: nn.Module, layers: int) -> dict[str, int]:
    """``experts`` and ``expert_params`` (one block's routed experts, averaged over the blocks: some models keep
    dense blocks between MoE ones), as the expert-parallel split finds them; nothing for a dense model."""
    from lightning_mgpu.parallel.experts import find_expert_lists, find_experts

    fused = list(find_experts(blocks).values())
    lists = [experts for _, experts in find_expert_lists(blocks).values()]
    if not fused and not lists:
        return {}
    counts = [m.get_parameter("gate_up_proj").shape[0] for m in fused]  # the global count, also once split
    counts += [len(experts) for experts in lists]
    params = {id(p): p.numel() for m in [*fused, *lists] for p in m.parameters()}
    return {
        "experts": max(counts),
        "expert_params": round(sum(params.values()) / layers),
        "fused_experts": bool(fused),
    }


def spec_from_path(path: str, init_args: str | None = None, **overrides: Any) -> ModelSpec:
    """``--module pkg.mod:Class [--init-args JSON]`` to a :class:`ModelSpec`, built on the meta device."""
    try:
        kwargs = json.loads(init_args) if init_args else {}
    except json.JSONDecodeError as error:
        raise ValueError(f"--init-args is not valid JSON ({error}): give e.g. '{{\"n_layer\": 12}}'.") from error
    if not isinstance(kwargs, dict):
        raise ValueError(f"--init-args must be a JSON object of keyword arguments, got {init_args!r}.")
    module = build_on_meta(load_class(path), kwargs)
    seq_len = overrides.pop("seq_len", None)
    return spec_from_module(module, seq_len=seq_len, **overrides)


def _configs(module: nn.Module) -> list[object]:
    """Objects that may hold the shapes: the module and its submodules, their ``config``, ``hparams``."""
    found: list[object] = []
    for sub in module.modules():
        for candidate in (getattr(sub, "config", None), sub, getattr(sub, "hparams", None)):
            if candidate is not None and all(candidate is not f for f in found):
                found.append(candidate)
    return found


def with_seq_len(spec: ModelSpec, seq_len: int) -> ModelSpec:
    return replace(spec, seq_len=seq_len)
