"""Execute an example notebook in a Jupyter kernel, as a user would, and read back what its cells printed."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from tests.helpers.processes import clean_env

CELL_TIMEOUT = 300


def python_kernel_name() -> str:
    """The installed kernel spec for Python ("python3" where it exists); skips the test where there is none."""
    jupyter_client = pytest.importorskip("jupyter_client.kernelspec")
    specs = jupyter_client.find_kernel_specs()
    if "python3" in specs:
        return "python3"
    manager = jupyter_client.KernelSpecManager()
    for name in sorted(specs):
        if manager.get_kernel_spec(name).language.lower() == "python":
            return name
    pytest.skip(f"no Jupyter kernel for Python is installed (found kernel specs: {sorted(specs) or 'none'})")


def execute(path: Path, workdir: Path, timeout: float = CELL_TIMEOUT) -> tuple[Any, float]:
    """Run every cell of ``path`` with ``workdir`` as the kernel's working and temporary directory.

    Raises nbclient's ``CellExecutionError`` (with the cell's source and traceback) on the first failing cell, which
    covers the notebook's own assertions. Returns the executed notebook and the seconds it took.
    """
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    nb = nbformat.read(path, as_version=4)
    client = nbclient.NotebookClient(
        nb,
        timeout=timeout,
        kernel_name=python_kernel_name(),
        allow_errors=False,
        resources={"metadata": {"path": str(workdir)}},
    )
    start = time.perf_counter()
    client.execute(env=clean_env(TMPDIR=str(workdir)))  # the notebooks' tempfile directories land in workdir
    return nb, time.perf_counter() - start


def text_outputs(nb: Any) -> str:
    """Everything the code cells printed (streams) and displayed as text, in order."""
    parts = []
    for cell in nb.cells:
        if cell.cell_type != "code":
            continue
        for output in cell.outputs:
            if "text" in output:
                parts.append(output["text"])
            elif "text/plain" in output.get("data", {}):
                parts.append(output["data"]["text/plain"])
    return "".join(parts)
