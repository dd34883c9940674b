"""The order in which a model's code uses its modules and parameters, read from its source.

A pipeline cut must know what runs before the blocks (embeddings, a ViT's ``cls_token`` and ``pos_embed``) and what
runs after them (final norm, head). Registration order does not tell: litgpt's ``GPT`` registers ``lm_head`` before
``transformer``, and a parameter held directly by the model (``cls_token``) has no place among its children at all.
The order of use does, and it can be read from the code without running it (no batch exists when the model is
split): starting at the LightningModule's ``training_step``, every ``self.<name>`` chain is recorded in source order,
a call of one of the module's own methods (``self.forward_features(x)``, ``self(x)``) is followed into that method,
and a call of a submodule (``self.model(input_ids=x)``) into the submodule's ``forward``.

The result is a list of qualified names (modules and parameters) in first-use order. Code that cannot be read
(no source, a C extension) ends the walk there; callers fall back to registration order for what it did not see.
"""

from __future__ import annotations

import ast
import functools
import inspect
import textwrap
from collections.abc import Callable

import torch
from torch import nn

_ENTRY_POINTS = ("training_step", "forward")
# Builtins that read about a module without running it: ``len(self.blocks)`` is not where the blocks run.
_INSPECTIONS = frozenset({"len", "isinstance", "hasattr", "getattr", "type", "id"})


def use_order(module: nn.Module) -> list[str]:
    """Qualified names of the submodules and parameters of ``module`` in the order its code first uses them."""
    walk = _Walk(module)
    for entry in _ENTRY_POINTS:
        method = getattr(type(module), entry, None)
        if method is not None and entry not in walk.visited_methods(module):
            walk.method(module, "", method)
    return walk.order


class _Walk:
    def __init__(self, root: nn.Module) -> None:
        self.root = root
        self.order: list[str] = []
        self._seen: set[str] = set()
        self._methods: set[tuple[int, str]] = set()

    def visited_methods(self, module: nn.Module) -> set[str]:
        return {name for owner, name in self._methods if owner == id(module)}

    def method(self, module: nn.Module, prefix: str, function: Callable[..., object]) -> None:
        """Walk ``function`` (a method of ``module``, whose qualified name is ``prefix``) in source order."""
        key = (id(module), getattr(function, "__qualname__", repr(function)))
        if key in self._methods:
            return
        self._methods.add(key)
        tree = _parse(function)
        if tree is None:
            return
        args = tree.args.posonlyargs + tree.args.args
        if not args:
            return
        _Visitor(self, module, prefix, args[0].arg, function).visit_body(tree.body)

    def record(self, name: str) -> None:
        if name and name not in self._seen:
            self._seen.add(name)
            self.order.append(name)

    def call_module(self, module: nn.Module, prefix: str) -> None:
        """A call of ``module`` itself: its ``forward`` is walked (once per module)."""
        forward = getattr(type(module), "forward", None)
        if forward is not None and type(module).__module__.split(".")[0] != "torch":
            self.method(module, prefix, forward)


class _Visitor(ast.NodeVisitor):
    """Visits one function body, resolving ``self.a.b`` chains against the module tree."""

    def __init__(
        self, walk: _Walk, module: nn.Module, prefix: str, self_name: str, function: Callable[..., object]
    ) -> None:
        self.walk = walk
        self.module = module
        self.prefix = prefix
        self.self_name = self_name
        self.function = function

    def visit_body(self, body: list[ast.stmt]) -> None:
        for statement in body:
            self.visit(statement)

    def visit_Assign(self, node: ast.Assign) -> None:  # the value is computed before it is stored
        self.visit(node.value)
        for target in node.targets:
            self.visit(target)

    def visit_For(self, node: ast.For) -> None:  # the iterable first (``for block in self.layers``)
        self.visit(node.iter)
        self.visit(node.target)
        self.visit_body(node.body)
        self.visit_body(node.orelse)

    def visit_Call(self, node: ast.Call) -> None:
        function = node.func
        if isinstance(function, ast.Name) and function.id in _INSPECTIONS:
            return
        for argument in [*node.args, *(k.value for k in node.keywords)]:  # arguments are evaluated first
            self.visit(argument)
        if isinstance(function, ast.Name) and function.id == self.self_name:  # self(x): the module's forward
            self.walk.call_module(self.module, self.prefix)
            return
        if isinstance(function, ast.Name) and function.id == "super":
            return
        if _is_super_call(function):  # super().forward(x): the parent class's method, walked in place
            parent = _parent_method(type(self.module), self.function, function.attr)  # type: ignore[attr-defined]
            if parent is not None:
                self.walk.method(self.module, self.prefix, parent)
            return
        chain = _chain(function, self.self_name)
        if chain is None:
            self.visit(function)
            return
        target, name, rest = self._resolve(chain)
        if isinstance(target, nn.Module) and not rest:  # self.child(x): the child runs
            self.walk.record(name)
            self.walk.call_module(target, name)
        elif len(rest) == 1 and isinstance(target, nn.Module):  # self.method(x) or self.child.method(x)
            self.walk.record(name)
            method = getattr(type(target), rest[0], None)
            if inspect.isfunction(method):
                self.walk.method(target, name, method)
        else:
            self.walk.record(name)

    def visit_Attribute(self, node: ast.Attribute) -> None:
        chain = _chain(node, self.self_name)
        if chain is None:
            self.generic_visit(node)
            return
        self.walk.record(self._resolve(chain)[1])

    def _resolve(self, chain: list[str]) -> tuple[nn.Module | torch.Tensor | None, str, list[str]]:
        """The deepest module or parameter ``chain`` names, its qualified name, and the attribute names left over."""
        target: nn.Module | torch.Tensor | None = self.module
        name = self.prefix
        for index, part in enumerate(chain):
            child = _child(target, part)
            if child is None:
                return target, name, chain[index:]
            target, name = child, f"{name}.{part}" if name else part
        return target, name, []


def _is_super_call(node: ast.expr) -> bool:
    """``super().name`` (the callee of ``super().name(...)``)."""
    return (
        isinstance(node, ast.Attribute)
        and isinstance(node.value, ast.Call)
        and isinstance(node.value.func, ast.Name)
        and node.value.func.id == "super"
    )


def _parent_method(cls: type, current: Callable[..., object], name: str) -> Callable[..., object] | None:
    """``name`` as ``super()`` finds it from the class that defines ``current``, or ``None``."""
    mro = cls.__mro__
    owner = next((i for i, c in enumerate(mro) if c.__dict__.get(getattr(current, "__name__", "")) is current), None)
    if owner is None:
        return None
    return next((c.__dict__[name] for c in mro[owner + 1 :] if inspect.isfunction(c.__dict__.get(name))), None)


def _child(module: object, name: str) -> nn.Module | torch.Tensor | None:
    """The submodule, parameter or buffer ``name`` of ``module``, or ``None``."""
    if not isinstance(module, nn.Module):
        return None
    value = getattr(module, name, None) if name in _registered(module) else None
    return value if isinstance(value, (nn.Module, torch.Tensor)) else None


def _registered(module: nn.Module) -> set[str]:
    return {
        *(n for n, _ in module.named_children()),
        *(n for n, _ in module.named_parameters(recurse=False)),
        *(n for n, _ in module.named_buffers(recurse=False)),
    }


def _chain(node: ast.expr, self_name: str) -> list[str] | None:
    """``["a", "b"]`` for ``self.a.b`` (subscripts ``self.a[0]`` stop the chain at ``a``), else ``None``."""
    parts: list[str] = []
    while isinstance(node, (ast.Attribute, ast.Subscript)):
        if isinstance(node, ast.Attribute):
            parts.append(node.attr)
        else:
            parts.clear()  # self.layers[i].attn: the container is what is named
        node = node.value
    if isinstance(node, ast.Name) and node.id == self_name and parts:
        return parts[::-1]
    return None


@functools.lru_cache(maxsize=1024)  # one parse per function, not per block instance
def _parse(function: Callable[..., object]) -> ast.FunctionDef | ast.AsyncFunctionDef | None:
    function = inspect.unwrap(function)
    try:
        source = textwrap.dedent(inspect.getsource(function))
    except (OSError, TypeError):
        return None
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return None
    node = tree.body[0] if tree.body else None
    return node if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) else None
