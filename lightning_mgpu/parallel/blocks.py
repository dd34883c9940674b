"""A model's structure as the parallelizers see it.

Its repeated blocks (the unit of FSDP sharding, pipeline stages and activation checkpointing) and its tied
weights (one Parameter held by several modules, which every split must keep one weight).
"""

from __future__ import annotations

import sys
from typing import Any, cast

import torch
from torch import nn


def find_block_container(module: nn.Module) -> tuple[str, nn.ModuleList | nn.Sequential | nn.ModuleDict] | None:
    """Return ``(fqn, container)`` of the largest ``ModuleList`` (or ``Sequential`` of 2+, or ``ModuleDict`` keyed
    ``"0"``, ``"1"``, ...) of blocks of one class.

    This is how a transformer keeps its layers (``transformer.h`` in nanoGPT, ``model.layers`` in Hugging Face
    Llama, ``transformer.h`` in GPT-2, ``layers`` as a ModuleDict in torchtitan's Llama). Returns ``None`` for models
    without such a list (a small CNN). Either way a block is the child named by its index: ``block_at(container, i)``.
    """
    best: tuple[int, str, nn.ModuleList | nn.Sequential | nn.ModuleDict] | None = None
    for name, child in module.named_modules():
        blocks = _indexed_blocks(child)
        if blocks is None or len(blocks) < (2 if isinstance(child, nn.Sequential) else 1):
            continue
        classes = {type(block) for block in blocks}
        if len(classes) != 1 or not any(True for _ in blocks[0].parameters()):
            continue
        size = sum(p.numel() for p in child.parameters())
        if best is None or size > best[0]:
            best = (size, name, child)
    return None if best is None else (best[1], best[2])


def _indexed_blocks(container: nn.Module) -> list[nn.Module] | None:
    """The children of a ModuleList/Sequential, or of a ModuleDict whose keys are their indices; else ``None``."""
    if isinstance(container, (nn.ModuleList, nn.Sequential)):
        return list(container)
    if isinstance(container, nn.ModuleDict) and list(container.keys()) == [str(i) for i in range(len(container))]:
        return list(container.values())
    return None


def block_at(container: nn.Module, index: int) -> nn.Module:
    """Block ``index`` of a container ``find_block_container`` returned (its child named ``str(index)``)."""
    return container.get_submodule(str(index))


def find_blocks(module: nn.Module) -> list[nn.Module]:
    """The repeated blocks of ``module``, in order; empty when it has none."""
    found = find_block_container(module)
    return [] if found is None else _indexed_blocks(found[1]) or []


def compile_blocks(module: nn.Module, options: dict[str, Any]) -> list[nn.Module]:
    """``torch.compile`` each repeated block's forward in place (``options``: torch.compile's keyword arguments).

    One graph per block class and shape, reused by every block: compiling the whole model would trace the loop over
    blocks and the step's Python. A shape change (a ragged last batch) recompiles once, then torch marks the
    dimension dynamic. The compiled forward is an instance attribute, removed when the run gives the module back.
    """
    blocks = find_blocks(module)
    for block in blocks:
        block.forward = torch.compile(block.forward, **options)
    return blocks


def network_copies(module: nn.Module) -> list[tuple[str, str]]:
    """Pairs ``(a, b)`` of sibling submodules with the same structure: a network and its copy (a DQN's target
    network, an EMA teacher), between which the user's code copies weights (``b.load_state_dict(a.state_dict())``).

    Siblings of one module that are themselves made of modules (single layers alike in shape, such as ``q_proj`` and
    ``k_proj``, are not copies of a network), hold parameters and match in every submodule's class and every
    parameter's and buffer's name, shape and dtype. Nothing inside a ModuleList/Sequential/ModuleDict counts: a
    model's blocks are alike by design, and so are parts of one block (a decoder layer's self- and cross-attention).
    """
    containers = [name for name, child in module.named_modules() if _indexed_blocks(child) is not None]
    pairs = []
    for parent_name, parent in module.named_modules():
        if any(parent_name == c or parent_name.startswith(f"{c}.") for c in containers):
            continue
        prefix = f"{parent_name}." if parent_name else ""
        children = [(f"{prefix}{n}", c) for n, c in parent.named_children() if _is_network(c)]
        signatures = [_structure(child) for _, child in children]
        for i, (name, _) in enumerate(children):
            pairs += [
                (name, other) for j, (other, _) in enumerate(children) if j > i and signatures[j] == signatures[i]
            ]
    return pairs


def _is_network(module: nn.Module) -> bool:
    """Made of modules and holding parameters, and not itself a list of blocks or layers."""
    composite = any(True for _ in module.children()) and _indexed_blocks(module) is None
    return composite and any(True for _ in module.parameters())


def _structure(module: nn.Module) -> tuple:
    tensors = lambda named: tuple((name, tuple(t.shape), t.dtype) for name, t in named)
    return (
        tuple((name, type(sub)) for name, sub in module.named_modules()),
        tensors(module.named_parameters()),
        tensors(module.named_buffers()),
    )


def tied_parameters(module: nn.Module) -> list[list[tuple[str, str]]]:
    """Groups of (module name, parameter name) that hold one and the same Parameter (tied weights)."""
    holders: dict[int, list[tuple[str, str]]] = {}
    for name, child in module.named_modules():
        for param_name, param in child.named_parameters(recurse=False):
            holders.setdefault(id(param), []).append((name, param_name))
    return [group for group in holders.values() if len(group) > 1]


# --------------------------------------------------------------------------------------- layer kinds, in one place
def _loaded_class(module_name: str, class_name: str) -> tuple[type, ...]:
    """A library's class if that library is loaded (a model using it has imported it), else nothing to match."""
    module = sys.modules.get(module_name)
    found = getattr(module, class_name, None)
    return (found,) if isinstance(found, type) else ()


def is_transposed_linear(module: nn.Module) -> bool:
    """Hugging Face's ``Conv1D`` (GPT-2): a Linear whose weight is stored ``(in, out)``."""
    return isinstance(module, _loaded_class("transformers.pytorch_utils", "Conv1D"))


def is_projection(module: nn.Module) -> bool:
    """A layer tensor parallelism shards by rows or columns: ``nn.Linear`` or a transposed one."""
    return isinstance(module, nn.Linear) or is_transposed_linear(module)


def projection_features(projection: nn.Module) -> tuple[int, int]:
    """(in, out) features of a projection: a Linear, or GPT-2's Conv1D (weight stored transposed)."""
    if isinstance(projection, nn.Linear):
        return projection.in_features, projection.out_features
    weight = cast(torch.Tensor, projection.weight)  # Conv1D's; nn.Module types attributes as Tensor | Module
    return weight.shape[0], weight.shape[1]


def is_float8_linear(module: nn.Module) -> bool:
    """torchao's ``Float8Linear`` (what ``fp8-mixed`` swaps ``nn.Linear`` for)."""
    return isinstance(module, _loaded_class("torchao.float8.float8_linear", "Float8Linear"))


def block_glob(name: str, blocks_fqn: str) -> str:
    """``transformer.h.3.attn.c_attn`` -> ``transformer.h.*.attn.c_attn``."""
    rest = name[len(blocks_fqn) + 1 :].split(".", 1)
    return f"{blocks_fqn}.*.{rest[1]}" if len(rest) == 2 else f"{blocks_fqn}.*"
