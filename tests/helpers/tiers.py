"""The two test tiers (docs/development.md): one parametrized case, put in the slow tier by a flag."""

from __future__ import annotations

from typing import Any

import pytest


def case(*values: Any, id: str | None = None, slow: bool = False) -> Any:
    """``pytest.param(*values, id=id)``, marked ``slow`` when ``slow`` (deselected by the README's test command)."""
    return pytest.param(*values, id=id, marks=[pytest.mark.slow] if slow else [])
