"""Tensor-parallel plans: which style each module gets, derived from Hugging Face plans or GPT-block name rules,
and from a block's data flow where the names do not place every layer (``derive.py``: BERT).

A plan maps module-name globs (``fnmatch`` over FQNs relative to the LightningModule) to style names; the styles
themselves are built in ``apply.py``.
"""

from __future__ import annotations

import fnmatch
from typing import Any

from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch import nn

from lightning_mgpu.layout import ParallelLayout
from lightning_mgpu.options import ParallelOptions
from lightning_mgpu.parallel.blocks import (
    block_glob,
    find_block_container,
    is_projection,
    network_copies,
    tied_parameters,
)
from lightning_mgpu.parallel.example import ExampleStep
from lightning_mgpu.parallel.tensor.checks import fused_chunks_differ
from lightning_mgpu.parallel.tensor.experts import PARAMETER_STYLES, names_parameters_only, owned_by_experts
from lightning_mgpu.parallel.tensor.multihead import STYLE as MULTIHEAD_STYLE
from lightning_mgpu.parallel.tensor.multihead import is_multihead_attention
from lightning_mgpu.parallel.tensor.styles import STYLES

# Leaf names of projections in GPT-style blocks (nanoGPT, litgpt, GPT-2, Llama-likes without a HF plan).
_FUSED_QKV = ("c_attn", "qkv", "qkv_proj", "Wqkv")
_COLWISE = (
    "q_proj",
    "k_proj",
    "v_proj",
    "query",
    "key",
    "value",
    "c_fc",
    "fc1",
    "fc_in",
    "up_proj",
    "gate_proj",
    "w1",
    "w3",
    "fc",
    "fc_1",
    "fc_2",
    "wq",
    "wk",
    "wv",
)  # litgpt: GptNeoxMLP.fc, LLaMAMLP.fc_1/fc_2; torchtitan and Meta's Llama: wq/wk/wv, w1/w3
_ROWWISE = ("c_proj", "o_proj", "out_proj", "down_proj", "fc2", "fc_out", "w2", "wo", "proj")
_TOKEN_EMBEDDINGS = ("wte", "embed_tokens", "tok_embeddings", "word_embeddings")
_HEADS = ("lm_head", "output", "embed_out")
# Hugging Face plan vocabulary (transformers.distributed.parallel_utils.ALL_PARALLEL_STYLES) -> ours.
_HF_STYLES = {
    "colwise": "colwise",
    "rowwise": "rowwise",
    "colwise_rep": "colwise_gather_output",
    "embedding_rowwise": "embedding_rowwise",
    "embedding_colwise": "embedding_colwise",
    "colwise_gather_output": "colwise_gather_output",
    # Input replicated (a fused q|k|v or gate|up gathered whole before slicing): each rank takes its slice.
    "rowwise_split_input": "rowwise_split_input",
    "rowwise_rep": "rowwise_split_input",
    "replicated_with_grad_allreduce": "replicated_with_grad_allreduce",
    "sequence_parallel": "sequence_parallel",
    "replicate": "replicate",
    # Experts (tensor/experts.py): the module runs on local shards of its 3-D parameters, which the
    # parameter entries place ('colwise'/'rowwise' there mean the weight's out/in dimension).
    "moe_tp_experts": "moe_tp_experts",
    "moe_identity_expert": "moe_identity_expert",
    "packed_colwise": "packed_colwise",
    "packed_rowwise": "packed_rowwise",
}
# Hugging Face styles not served, and what an explicit plan does instead: the module stays replicated (whole on
# every rank); the rest of the block stays sharded.
_HF_REFUSED = {
    "grouped_gemm": "expert parallelism (experts split across ranks), not tensor parallelism",
    "ep_dispatch_experts": "expert parallelism (tokens dispatched to the ranks holding their experts)",
    "mla_kv_a_proj": "DeepSeek-style MLA: part of a projection's output bypasses the sharded layers",
    "all_reduce": "a module's partial output all-reduced by Hugging Face's own forward hook",
    "local_params": "a bare parameter sharded and read as local tensors by Hugging Face's own kernels",
}
# Refused styles whose module alone is kept whole (experts, an attention with sinks); for the others its parent.
_HF_REFUSED_KEEP_MODULE = ("grouped_gemm", "ep_dispatch_experts", "local_params")

# Every style name a plan may give: a module's (tensor_styles.STYLES), or a parameter's of an experts module.
STYLE_NAMES = (*STYLES, *(name for name in PARAMETER_STYLES if name not in STYLES))


def check_options(options: ParallelOptions) -> None:
    """The tensor-parallel options checked before any process starts: a dict ``tp_plan`` names known styles."""
    if isinstance(options.tp_plan, dict):
        check_style_names(options.tp_plan)


def check(layout: ParallelLayout, options: ParallelOptions) -> None:
    """The options against one layout: nothing of tensor parallelism depends on the other degrees (the plan's
    divisibility by ``tp`` is checked on the module, when it is applied), so the options alone."""
    check_options(options)


def check_style_names(plan: dict[str, str]) -> None:
    """The one check that a plan names known styles (run with the options, and again on any plan applied)."""
    unknown = {glob: style for glob, style in plan.items() if style not in STYLE_NAMES}
    if unknown:
        raise ValueError(f"`tp_plan` has unknown styles {unknown}; use one of {list(STYLE_NAMES)}.")


def auto_plan(module: nn.Module, sequence_parallel: bool = False, example: ExampleStep | None = None) -> dict[str, str]:
    """Derive ``{fqn: style}`` for ``module``: Hugging Face plans first, GPT-block name rules (or the blocks' data
    flow, read from their call in ``example``, the user's step on one batch, where it can run) for the rest."""
    plan: dict[str, str] = {}
    covered: set[str] = set()
    for prefix, hf_model in _hugging_face_models(module):
        plan.update(_hugging_face_plan(prefix, hf_model, module))
        covered.add(prefix)
    found = find_block_container(module)
    if found is not None and not any(found[0].startswith(c) for c in covered):
        plan.update(_block_rules(module, found[0], example))
    if not plan:
        linears = [name for name, child in module.named_modules() if is_projection(child)]
        raise ValueError(
            "tp_plan='auto' found neither a Hugging Face tensor-parallel plan nor a list of repeated blocks to shard."
            f" Linear layers in the model: {linears[:12]}{' ...' if len(linears) > 12 else ''}. Pass `tp_plan` as a"
            f" dict {{module_glob: style}} (styles: {list(STYLE_NAMES)}) or a callable (module, tp_mesh)."
        )
    if sequence_parallel:
        plan.update(_sequence_parallel_rules(module, plan))
    return plan


def _hugging_face_models(module: nn.Module) -> list[tuple[str, nn.Module]]:
    """The Hugging Face models in ``module`` that declare a tensor-parallel plan, outermost first. A model's class
    names its ``base_model_prefix``: wrappers that forward attributes to the model they hold (``peft``'s
    ``PeftModel`` and ``LoraModel``) are looked through, so the plan's names are the model's own."""
    models: list[tuple[str, nn.Module]] = []
    for name, child in module.named_modules():
        plan = getattr(getattr(child, "config", None), "base_model_tp_plan", None)
        declared = isinstance(getattr(type(child), "base_model_prefix", None), str)
        if plan and declared and not any(name.startswith(p + ".") for p, _ in models):
            models.append((name, child))
    return models


def _hugging_face_plan(prefix: str, hf_model: Any, root: nn.Module) -> dict[str, str]:
    head = f"{prefix}." if prefix else ""
    # transformers >= 4.5x merges the class plan and config.base_model_tp_plan into the instance's `_tp_plan`.
    plan = dict(getattr(hf_model, "_tp_plan", None) or {})
    base = hf_model.base_model_prefix
    if not any(key.startswith(base + ".") for key in plan) and hasattr(hf_model, base):
        plan.update({f"{base}.{glob}": s for glob, s in hf_model.config.base_model_tp_plan.items()})
    if getattr(hf_model.config, "tie_word_embeddings", False):
        # A head tied to the input embedding cannot be sharded two ways: keep both replicated.
        plan = {
            glob: s
            for glob, s in plan.items()
            if s not in ("colwise_gather_output", "colwise_rep", "embedding_rowwise")
        }
    plan = {f"{head}{glob}": s for glob, s in plan.items()}
    # Rules for layers this configuration does not build (Qwen3-MoE's dense MLPs when every layer is sparse) are
    # unused, as in Hugging Face's own tensor parallelism.
    names = [name for name, _ in root.named_modules() if name] + [name for name, _ in root.named_parameters()]
    plan = {glob: s for glob, s in plan.items() if any(fnmatch.fnmatchcase(n, glob) for n in names)}
    _refuse_unmapped_styles(plan, root)
    return _shard_packed_gate_up({glob: _hf_style(s) for glob, s in plan.items()})


def _shard_packed_gate_up(plan: dict[str, str]) -> dict[str, str]:
    """Phi-3's plan gathers its packed ``gate_up_proj`` output whole (``colwise_gather_output``) so that the MLP can
    ``chunk(2)`` it, and slices it again for ``down_proj`` (``rowwise_split_input``). Sharded as two chunks instead
    (``colwise_gate_up``), each rank holds its halves of gate and up, the MLP runs on them and ``down_proj`` is
    plainly row-parallel: one all-reduce per MLP, as for separate gate and up projections."""
    plan = dict(plan)
    for glob, s in list(plan.items()):
        parent, _, leaf = glob.rpartition(".")
        partners = [g for g, t in plan.items() if t == "rowwise_split_input" and g.rpartition(".")[0] == parent]
        if s == "colwise_gather_output" and leaf == "gate_up_proj" and len(partners) == 1:
            plan[glob], plan[partners[0]] = "colwise_gate_up", "rowwise"
        # Inkling's experts: their packed [gate | up] given plain 'colwise', whose contiguous shard would hand rank 0
        # only gate rows for the experts' chunk(2) to split as gate and up.
        if s == "colwise" and leaf == "gate_up_proj" and plan.get(parent) == "moe_tp_experts":
            plan[glob] = "packed_colwise"
    return plan


def _refuse_unmapped_styles(plan: dict[str, str], root: nn.Module) -> None:
    """Before training: name each Hugging Face style not served (and plan entries naming parameters, which
    transformers >= 5 shards one by one), with the explicit ``tp_plan`` that trains instead."""
    modules = [name for name, _ in root.named_modules() if name]
    names_module = {glob: any(fnmatch.fnmatchcase(n, glob) for n in modules) for glob in plan}
    refused = {glob: s for glob, s in plan.items() if s in _HF_REFUSED or s not in _HF_STYLES}
    on_parameters = {
        glob: s
        for glob, s in plan.items()
        if glob not in refused and not names_module[glob] and not owned_by_experts(glob, plan)
    }
    if not refused and not on_parameters:
        return
    whole = []  # globs whose subtree stays replicated
    for glob, s in refused.items():
        if not names_module[glob]:
            whole.append(glob.rsplit(".", 1)[0])  # a parameter: its module
        elif s in _HF_REFUSED_KEEP_MODULE:
            whole.append(glob)
        else:
            whole.append(glob.rsplit(".", 1)[0] if "." in glob else glob)
    whole += [glob.rsplit(".", 1)[0] for glob in on_parameters]
    explicit = {
        glob: _HF_STYLES[s]
        for glob, s in plan.items()
        if glob not in refused
        and (names_module[glob] or owned_by_experts(glob, plan))
        and s in _HF_STYLES
        and not any(glob == w or glob.startswith(w + ".") for w in whole)
    }
    styles = sorted(set(refused.values()))
    reasons = "; ".join(f"{s!r}: {_HF_REFUSED.get(s, 'not a style lightning-mgpu knows')}" for s in styles)
    parameters = f" Entries naming parameters rather than modules: {sorted(on_parameters)}." if on_parameters else ""
    lead = (
        f"The model's Hugging Face tensor-parallel plan uses style{'s' if len(styles) > 1 else ''} {styles},"
        f" which lightning-mgpu does not map ({reasons}), at {sorted(refused)}."
        if styles
        else "The model's Hugging Face tensor-parallel plan shards parameters one by one; lightning-mgpu shards"
        " modules."
    )
    raise ValueError(
        f"{lead}{parameters} Pass this explicit `tp_plan`,"
        f" which keeps {sorted(set(whole))} replicated (whole on every rank) and shards the rest as Hugging Face"
        f" does: tp_plan={explicit!r}"
    )


def _hf_style(name: str) -> str:
    if name not in _HF_STYLES:
        raise ValueError(
            f"The model's Hugging Face tensor-parallel plan uses style {name!r}, which lightning-mgpu does not map."
            f" Pass an explicit `tp_plan` dict with styles from {list(STYLE_NAMES)}."
        )
    return _HF_STYLES[name]


def _warn_whole_attention(glob: str) -> None:
    rank_zero_warn(
        f"tp_plan='auto': {glob} fuses q, k and v of grouped-query attention in chunks of different sizes, which"
        " 'colwise_qkv' (three equal chunks) cannot shard; that attention is kept whole (replicated) on every"
        " tensor-parallel rank and the MLP is sharded. Separate q/k/v projections shard the attention too."
    )


def _block_rules(module: nn.Module, blocks_fqn: str, example: ExampleStep | None = None) -> dict[str, str]:
    plan: dict[str, str] = {}
    unplaced: list[str] = []
    attentions: list[str] = []  # torch's nn.MultiheadAttention: sharded whole, by heads (its out_proj with it)
    for name, child in module.named_modules():
        if not name.startswith(blocks_fqn + ".") or any(name.startswith(f"{a}.") for a in attentions):
            continue
        glob = block_glob(name, blocks_fqn)
        if is_multihead_attention(child):
            attentions.append(name)
            plan[glob] = MULTIHEAD_STYLE
            continue
        if not is_projection(child):
            continue
        leaf = name.rsplit(".", 1)[-1]
        if leaf in _FUSED_QKV and fused_chunks_differ(module, name):
            _warn_whole_attention(glob)  # one message for every block: shown once
            plan[glob] = "replicate"
        elif leaf in _FUSED_QKV:
            plan[glob] = "colwise_qkv"
        elif leaf in _COLWISE:
            plan[glob] = "colwise"
        elif leaf in _ROWWISE:
            plan[glob] = "rowwise"
        else:
            unplaced.append(name)
    for glob in [g for g, style in plan.items() if style == "replicate"]:  # the whole attention stays whole
        attention = glob.rpartition(".")[0]
        plan.update({g: "replicate" for g, style in plan.items() if g.rpartition(".")[0] == attention})
    if unplaced:  # names alone do not place every layer (BERT's `dense`): derive the plan from the data flow
        from lightning_mgpu.parallel.tensor.derive import derive_block_plan

        return derive_block_plan(module, blocks_fqn, example)
    if not plan:
        from lightning_mgpu.parallel.tensor.derive import no_linear_layers

        raise no_linear_layers(blocks_fqn)
    return plan


def _sequence_parallel_rules(module: nn.Module, plan: dict[str, str]) -> dict[str, str]:
    """Norms run on sequence shards; the token embedding scatters its output and the head gathers its input."""
    rules: dict[str, str] = {}
    found = find_block_container(module)
    blocks = found[0] + "." if found else None
    for name, child in module.named_modules():
        leaf = name.rsplit(".", 1)[-1]
        # Norms on the residual stream only: children of a block, or outside the blocks (not q/k norms on heads).
        on_stream = blocks is None or not name.startswith(blocks) or name[len(blocks) :].count(".") == 1
        if _is_norm(child) and on_stream:
            rules[name] = "sequence_parallel"
        elif isinstance(child, nn.Embedding) and leaf in _TOKEN_EMBEDDINGS:
            rules[name] = "embedding_rowwise"
        elif is_projection(child) and leaf in _HEADS and not any(fnmatch.fnmatchcase(name, g) for g in plan):
            rules[name] = "colwise_gather_output"
    if not any(s.startswith("embedding") for s in (*plan.values(), *rules.values())):
        raise ValueError(  # its norms would take every rank's whole sequence for a shard of it
            "sequence_parallel=True splits the residual stream over the sequence where it enters the blocks, which"
            f" tp_plan='auto' does at the token embedding (an nn.Embedding named one of {list(_TOKEN_EMBEDDINGS)}),"
            " and this model has none (a vision encoder's patch embedding is a convolution, which DTensor cannot"
            " differentiate when sharded). Use tensor parallelism without sequence_parallel for it, or pass a"
            " callable `tp_plan` (module, tp_mesh) that shards the stream where it enters the blocks."
        )
    return rules


def _with_vocab_parallel_head(module: nn.Module, plan: dict[str, str]) -> dict[str, str]:
    """``loss_parallel``: the LM head keeps its logits sharded over the vocabulary for the user's cross-entropy."""
    plan = {
        glob: "colwise_loss_parallel" if s == "colwise_gather_output" and glob.rsplit(".", 1)[-1] in _HEADS else s
        for glob, s in plan.items()
    }
    if "colwise_loss_parallel" not in plan.values():
        for name, child in module.named_modules():
            if is_projection(child) and name.rsplit(".", 1)[-1] in _HEADS:
                if not any(fnmatch.fnmatchcase(name, glob) for glob in plan):
                    plan[name] = "colwise_loss_parallel"
    if "colwise_loss_parallel" not in plan.values():
        raise ValueError(
            "`loss_parallel=True` needs the LM head sharded over the vocabulary, but the plan has no head (modules"
            f" named one of {list(_HEADS)}). Add {{'<head module>': 'colwise_loss_parallel'}} to `tp_plan`."
        )
    # A head tied to the input embedding: shard the embedding over the vocabulary too, so the two stay one weight.
    heads = {name for name, s in _match(module, plan).items() if s == "colwise_loss_parallel"}
    for group in tied_parameters(module):
        if any(name in heads for name, _ in group):
            for name, _ in group:
                if isinstance(module.get_submodule(name), nn.Embedding) and name not in _match(module, plan):
                    plan[name] = "embedding_rowwise"
    return plan


def _is_norm(module: nn.Module) -> bool:
    name = type(module).__name__
    return isinstance(module, nn.LayerNorm) or (name.endswith("Norm") and "Group" not in name and "Batch" not in name)


def with_network_copies(module: nn.Module, matched: dict[str, str]) -> dict[str, str]:
    """``matched`` with a network's copy (a DQN's target network, an EMA teacher: ``blocks.network_copies``) sharded
    as the plan shards the network, where the plan names nothing of the copy: weights copied between the two
    (``target_net.load_state_dict(net.state_dict())``, an EMA update) must have the same layouts on both, and the
    copy's forward computes what it computed whole (tensor parallelism is exact)."""
    added: dict[str, str] = {}
    for first, second in network_copies(module):
        for source, copy in ((first, second), (second, first)):
            under = lambda name, root: name == root or name.startswith(f"{root}.")
            if any(under(name, copy) for name in matched):
                continue
            mapped = {f"{copy}{name[len(source) :]}": s for name, s in matched.items() if under(name, source)}
            if mapped:
                rank_zero_info(
                    "tensor parallelism shards %s as %s (a copy of it: the same modules and parameter shapes), so"
                    " that weights copied between them keep their layouts",
                    copy,
                    source,
                )
                added.update(mapped)
    return {**matched, **added}


def _match(module: nn.Module, plan: dict[str, str]) -> dict[str, str]:
    """Expand globs to module FQNs; the most specific (longest) glob wins. A glob matching nothing is an error."""
    names = [name for name, _ in module.named_modules() if name]
    matched: dict[str, tuple[int, str]] = {}
    check_style_names(plan)
    for glob, style_name in plan.items():
        hits = [n for n in names if fnmatch.fnmatchcase(n, glob)]
        if not hits and style_name in PARAMETER_STYLES and names_parameters_only(module, glob):
            continue  # a parameter's placement, read by its experts module's style (tensor/experts.py)
        if not hits:
            raise ValueError(
                f"`tp_plan` entry {glob!r} matches no module. Module names look like: {names[:8]} ..."
                " (globs are matched against names relative to the LightningModule)."
            )
        for name in hits:
            if name not in matched or len(glob) > matched[name][0]:
                matched[name] = (len(glob), style_name)
    return {name: style_name for name, (_, style_name) in matched.items()}
