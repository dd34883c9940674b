"""The framework versions the package is tested with, checked when ``lightning_mgpu._compat`` (the first shim) is
imported.

pyproject's bounds keep pip from installing others, but an environment can still hold them (a later
``pip install torch==...``, ``--no-deps``, a source checkout on ``PYTHONPATH``). The shims beside this file rely on
internals checked on exactly the minor releases in :data:`lightning_mgpu._compat.CHECKED`; some of them would not
fail on another release but misbehave (a renamed torchmetrics state is set as a new attribute and never read), so
an older release or another minor release is refused here, by name, before any shim is imported.
``LIGHTNING_MGPU_SKIP_VERSION_CHECK=1`` skips the check, for trying a new release on purpose.
"""

from __future__ import annotations

import os
import re

from lightning_mgpu._compat import CHECKED, installed_version

SKIP_VARIABLE = "LIGHTNING_MGPU_SKIP_VERSION_CHECK"


def check_versions() -> None:
    """Raise ``ImportError`` naming every framework installed in a release older than or past the tested minor."""
    if os.environ.get(SKIP_VARIABLE) == "1":
        return
    wrong = [
        f"{package} {installed} (tested: {checked}, supported: {_bounds(checked)})"
        for package, checked in CHECKED.items()
        if not _supported(installed := installed_version(package), checked)
    ]
    if wrong:
        raise ImportError(
            f"lightning_mgpu does not support the installed {', '.join(wrong)}: it relies on internals checked on the"
            f" tested releases. Install them (`pip install {' '.join(_pins())}`), or set"
            f" {SKIP_VARIABLE}=1 to try these at your own risk."
        )


def _supported(installed: str, checked: str) -> bool:
    """The checked release or a later patch release of the same minor (``2.13.1+cpu`` for ``2.13.0``)."""
    release, tested = _release(installed), _release(checked)
    return release[:2] == tested[:2] and release >= tested


def _release(version: str) -> tuple[int, ...]:
    """``"2.13.0+cpu"`` -> ``(2, 13, 0)``; ``()`` for something that is not a version (``"not installed"``)."""
    match = re.match(r"\d+(\.\d+)*", version)
    return tuple(int(part) for part in match[0].split(".")) if match else ()


def _bounds(checked: str) -> str:
    major, minor = _release(checked)[:2]
    return f">={checked},<{major}.{minor + 1}"


def _pins() -> list[str]:
    return [f"'{package}{_bounds(checked)}'" for package, checked in CHECKED.items()]


check_versions()
