"""A model's structure as the parallelizers see it.

Its repeated blocks (the unit of FSDP sharding, pipeline stages and activation checkpointing) and its tied
weights (one Parameter held by several modules, which every split must keep one weight).
"""

from __future__ import annotations

from torch import nn


def find_block_container(module: nn.Module) -> tuple[str, nn.ModuleList | nn.Sequential] | None:
    """Return ``(fqn, container)`` of the largest ``ModuleList`` (or ``Sequential`` of 2+) of blocks of one class.

    This is how a transformer keeps its layers (``transformer.h`` in nanoGPT, ``model.layers`` in Hugging Face
    Llama, ``transformer.h`` in GPT-2). Returns ``None`` for models without such a list (a small CNN).
    """
    best: tuple[int, str, nn.ModuleList | nn.Sequential] | None = None
    for name, child in module.named_modules():
        if not isinstance(child, (nn.ModuleList, nn.Sequential)) or len(child) < (1 if isinstance(child, nn.ModuleList) else 2):
            continue
        classes = {type(block) for block in child}
        if len(classes) != 1 or not any(True for _ in child[0].parameters()):
            continue
        size = sum(p.numel() for p in child.parameters())
        if best is None or size > best[0]:
            best = (size, name, child)
    return None if best is None else (best[1], best[2])


def find_blocks(module: nn.Module) -> list[nn.Module]:
    """The repeated blocks of ``module``, in order; empty when it has none."""
    found = find_block_container(module)
    return [] if found is None else list(found[1])


def tied_parameters(module: nn.Module) -> list[list[tuple[str, str]]]:
    """Groups of (module name, parameter name) that hold one and the same Parameter (tied weights)."""
    holders: dict[int, list[tuple[str, str]]] = {}
    for name, child in module.named_modules():
        for param_name, param in child.named_parameters(recurse=False):
            holders.setdefault(id(param), []).append((name, param_name))
    return [group for group in holders.values() if len(group) > 1]
