"""Outside ``lightning_mgpu/_compat``, the package uses no private torch, Lightning or torchmetrics API.

Found statically (``ast``): imports of private modules or names from those packages; attribute reads and writes of
private names (``obj._x``) unless the name is one the package defines itself and no framework class or instance
has (``module._device_mesh`` is Lightning's); ``getattr``-style access of any private name on another object, the
package's own included (read it through a public property); and ``self._x`` in a class derived from one of their
classes when that class chain does not define ``_x``. Found at
run time: methods of our classes that override a private method of one of their classes (``_apply`` on a
``ParallelStyle``). Each offender is listed with its file and line.
"""

from __future__ import annotations

import ast
import functools
import importlib
import inspect
from pathlib import Path

import torch

import lightning_mgpu

FRAMEWORKS = ("torch", "lightning", "pytorch_lightning", "lightning_fabric", "torchmetrics")
PACKAGE = Path(lightning_mgpu.__file__).parent
# Private names of other libraries (not the frameworks this check is about), read where they are the only way.
OTHER_LIBRARIES = {
    "_tp_plan": "transformers: a PreTrainedModel class's tensor-parallel plan",
    "_init_weights": "transformers: a PreTrainedModel's initializer of one module, what from_pretrained runs on"
    " missing weights (parallel/materialize.py runs it on one module's full-size copy)",
    "_is_hf_initialized": "transformers: the flag its initializers read to skip a tensor already loaded",
}
# Names Python's own machinery puts on classes (abc, typing), not private APIs of the frameworks.
# Set on a subclass by the language or a framework metaclass, not by the subclass's code: ``_backward_cls`` is what
# torch's ``FunctionMeta`` gives every ``torch.autograd.Function`` subclass (a custom Function is public API).
_MACHINERY = {"_abc_impl", "_is_protocol", "_is_runtime_protocol", "_backward_cls"}


def _framework_privates() -> set[str]:
    """Private names on the framework classes the package works with: reported even where a helper of ours has
    the same name (``mesh._unflatten`` stays a DeviceMesh internal though the package has an ``_unflatten``)."""
    import lightning.pytorch as pl
    import torchmetrics
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor
    from torch.utils.data import DataLoader

    classes = (
        torch.nn.Module,
        torch.Tensor,
        DTensor,
        DeviceMesh,
        DataLoader,
        torch.optim.Optimizer,
        torch.amp.GradScaler,
        pl.Trainer,
        pl.LightningModule,
        pl.strategies.Strategy,
        pl.plugins.precision.Precision,
        torchmetrics.Metric,
    )
    # Attributes their instances set in __init__ (``LightningModule._device_mesh``), which no class lists.
    instances = (torch.nn.Module(), pl.LightningModule())
    return {name for obj in (*classes, *instances) for name in (*dir(obj), *vars(obj)) if _private(name)}


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _framework(module: str) -> bool:
    return module.split(".")[0] in FRAMEWORKS


def _files() -> list[Path]:
    return sorted(p for p in PACKAGE.rglob("*.py") if "_compat" not in p.relative_to(PACKAGE).parts)


def _own_names(trees: dict[Path, ast.AST]) -> set[str]:
    """Private names the package defines: functions, classes, module names, ``self.x`` attributes, arguments."""
    names: set[str] = set()
    for tree in trees.values():
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                names.add(node.id)
            elif isinstance(node, ast.arg):
                names.add(node.arg)
            elif (
                isinstance(node, ast.Attribute)
                and isinstance(node.ctx, ast.Store)
                and isinstance(node.value, ast.Name)
                and node.value.id in ("self", "cls")
            ):
                names.add(node.attr)
    return names


def _imported_names(tree: ast.AST) -> tuple[set[str], set[str]]:
    """Names bound by imports: (from a framework, from anywhere else)."""
    framework, other = set(), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                bound = alias.asname or alias.name.split(".")[0]
                (framework if _framework(alias.name) else other).add(bound)
        elif isinstance(node, ast.ImportFrom):
            source = node.module or ""
            for alias in node.names:
                (framework if node.level == 0 and _framework(source) else other).add(alias.asname or alias.name)
    return framework, other - framework


def _class_scopes(tree: ast.AST, framework_names: set[str]) -> dict[ast.ClassDef, tuple[bool, set[str]]]:
    """Each class: (derives from a framework class, the private names it defines itself)."""
    scopes = {}
    for node in ast.walk(tree):
        if not isinstance(node, ast.ClassDef):
            continue
        bases = [
            b.value.id if isinstance(b, ast.Attribute) and isinstance(b.value, ast.Name) else getattr(b, "id", None)
            for b in node.bases
        ]
        defined = {n.name for n in node.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
        for sub in ast.walk(node):
            if (
                isinstance(sub, ast.Attribute)
                and isinstance(sub.ctx, ast.Store)
                and isinstance(sub.value, ast.Name)
                and sub.value.id == "self"
            ):
                defined.add(sub.attr)
            elif isinstance(sub, ast.Assign):
                defined.update(t.id for t in sub.targets if isinstance(t, ast.Name))
            elif isinstance(sub, ast.AnnAssign) and isinstance(sub.target, ast.Name):
                defined.add(sub.target.id)  # declared by a mixin for the class that sets it (`_pipeline: ...`)
        scopes[node] = (any(b in framework_names for b in bases), defined)
    return scopes


def _static_offenders(files: list[Path] | None = None) -> list[str]:
    """Offenders in ``files`` (the whole package by default)."""
    trees = {path: ast.parse(path.read_text(), str(path)) for path in (_files() if files is None else files)}
    framework = _framework_privates()
    ours = _own_names(trees) - framework
    offenders = []
    for path, tree in trees.items():
        where = path.relative_to(PACKAGE.parent)
        framework_names, other_modules = _imported_names(tree)
        scopes = _class_scopes(tree, framework_names)

        def report(node: ast.AST, what: str) -> None:
            offenders.append(f"{where}:{node.lineno}: {what}")

        def visit(node: ast.AST, scope: tuple[bool, set[str]] | None) -> None:
            if isinstance(node, ast.ClassDef):
                scope = scopes[node] if scopes[node][0] or scope is None else scope
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module and _framework(node.module):
                if any(_private(part) for part in node.module.split(".")):
                    report(node, f"from {node.module} import ...")
                for alias in node.names:
                    if _private(alias.name):
                        report(node, f"from {node.module} import {alias.name}")
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if _framework(alias.name) and any(_private(part) for part in alias.name.split(".")):
                        report(node, f"import {alias.name}")
            elif isinstance(node, ast.Attribute) and _private(node.attr) and node.attr not in OTHER_LIBRARIES:
                base = node.value
                if isinstance(base, ast.Name) and base.id in other_modules:
                    pass  # e.g. os._exit, or one of our own modules
                elif isinstance(base, ast.Name) and base.id in ("self", "cls"):
                    if scope is not None and scope[0] and node.attr not in scope[1]:
                        report(node, f"self.{node.attr} (a framework base class's private attribute)")
                elif node.attr not in ours and not node.attr.startswith("_lightning_mgpu"):
                    report(node, f".{node.attr}")
            elif (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Name)
                and node.func.id in ("getattr", "setattr", "hasattr", "delattr")
                and len(node.args) > 1
                and isinstance(node.args[1], ast.Constant)
                and isinstance(node.args[1].value, str)
            ):
                name = node.args[1].value
                on_self = isinstance(node.args[0], ast.Name) and node.args[0].id in ("self", "cls")
                if (
                    _private(name)
                    and not on_self
                    and name not in OTHER_LIBRARIES
                    and not name.startswith("_lightning_mgpu")
                ):
                    report(node, f"{node.func.id}(..., {name!r})")
            elif (
                isinstance(node, ast.Subscript)
                and isinstance(node.value, ast.Attribute)
                and node.value.attr == "__dict__"
                and isinstance(node.slice, ast.Constant)
                and isinstance(node.slice.value, str)
                and _private(node.slice.value)
                and node.slice.value not in ours
            ):
                report(node, f"__dict__[{node.slice.value!r}]")
            for child in ast.iter_child_nodes(node):
                visit(child, scope)

        visit(tree, None)
    return offenders


def _override_offenders(files: list[Path] | None = None) -> list[str]:
    offenders = []
    for path in _files() if files is None else files:
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        try:
            module = importlib.import_module(name)
        except ImportError as error:  # an optional dependency: its static check above still ran
            if "lightning_mgpu" in str(error):
                raise
            continue
        for cls in vars(module).values():
            if not inspect.isclass(cls) or cls.__module__ != name:
                continue
            foreign = [b for b in cls.__mro__[1:] if _framework(b.__module__)]
            for attr in vars(cls):
                if _private(attr) and attr not in _MACHINERY and any(attr in vars(b) for b in foreign):
                    line = inspect.getsourcelines(cls)[1]
                    offenders.append(
                        f"{path.relative_to(PACKAGE.parent)}:{line}: {cls.__name__}.{attr} overrides a"
                        f" framework class's private {attr}"
                    )
    return offenders


@functools.lru_cache(maxsize=1)
def _package_offenders() -> tuple[str, ...]:
    return tuple(_static_offenders() + _override_offenders())


def test_no_private_framework_api_outside_compat():
    left = _package_offenders()
    assert not left, (
        "Private torch/Lightning/torchmetrics API used outside lightning_mgpu/_compat (add a shim there, documented"
        " with the public API it stands in for, and a contract test in tests/_compat/test_contract.py):\n"
        + "\n".join(sorted(left))
    )


def test_the_scan_finds_what_it_is_meant_to_find():
    """The checks are not vacuous: a planted private import, attribute and override are each reported (the scan of
    the planted file alone: the package's own files were scanned by the test above)."""
    planted = PACKAGE / "_planted_for_test.py"
    planted.write_text(
        "import os\nfrom torch.utils._pytree import tree_map\n"
        "from torch.distributed.tensor.parallel import ParallelStyle\n"
        "def f(m, s):\n    return m._forward_hooks, getattr(m, '_buffers'), os._exit, getattr(s, '_layout')\n"
        "def g(module, mesh):\n    module._device_mesh = mesh\n"
        "class S(ParallelStyle):\n    def _apply(self, module, mesh):\n        return self._private_of_torch\n"
    )
    try:
        offenders = "\n".join(_static_offenders([planted]) + _override_offenders([planted]))
    finally:
        planted.unlink()
    for expected in (
        ":2: from torch.utils._pytree",
        ":5: ._forward_hooks",
        "getattr(..., '_buffers')",
        "getattr(..., '_layout')",  # a private of ours, read on another object
        ":7: ._device_mesh",  # a LightningModule instance's private, written
        "self._private_of_torch",
        "S._apply overrides",
    ):
        assert expected in offenders, (expected, offenders)
    assert "_exit" not in offenders.replace("_planted", "")  # os is not a framework
