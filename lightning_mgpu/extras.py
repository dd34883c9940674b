"""The optional packages and the pip extra of ``lightning-mgpu`` that installs each (pyproject's
``[project.optional-dependencies]``; ``tests/cli`` checks the two agree), so that a missing one is named with the
command that installs it."""

from __future__ import annotations

import importlib.util

# package: the extra installing it
EXTRAS = {
    "deepspeed": "deepspeed",
    "torchao": "fp8",
    "matplotlib": "monitor",
    "safetensors": "safetensors",
    "transformers": "examples",
}


def install_hint(package: str) -> str:
    """``pip install 'lightning-mgpu[extra]'`` (or the plain package when no extra holds it)."""
    extra = EXTRAS.get(package)
    return f"pip install 'lightning-mgpu[{extra}]' (or pip install {package})" if extra else f"pip install {package}"


class MissingExtra(ImportError):
    """An optional package that ``what`` needs is not installed; the message says what installs it."""

    def __init__(self, what: str, package: str) -> None:
        super().__init__(f"{what} needs the {package!r} package, which is not installed: {install_hint(package)}.")
        self.name = package


def require(package: str, what: str) -> None:
    """Raise :class:`MissingExtra` unless ``package`` can be imported (checked before any work starts)."""
    if importlib.util.find_spec(package) is None:
        raise MissingExtra(what, package)
