"""The documentation cannot drift from the code: every argument is documented where the IDE shows it, and every
Python snippet of the docs site runs.

The site itself is built in strict mode by ``.ci/run`` (``mkdocs build --strict``: broken links and references fail).
"""

from __future__ import annotations

import inspect
import re
import subprocess
import sys
from pathlib import Path

import pytest

from lightning_mgpu import HybridPrecision, HybridStrategy, ScalingMonitor

REPO = Path(__file__).resolve().parents[1]
DOCS = REPO / "docs"
# A fence whose info string is `python` (optionally with attributes) is executed; `py` shows code that cannot run
# here (a GPU, a user's own model).
_PYTHON_BLOCK = re.compile(r"^```python[^\n]*\n(.*?)^```\s*$", re.MULTILINE | re.DOTALL)


def _documented_arguments(cls: type) -> list[str]:
    doc = inspect.getdoc(cls) or ""
    assert "\nArgs:\n" in doc, f"{cls.__name__}'s docstring has no Args: section"
    section = doc.split("\nArgs:\n", 1)[1]
    names = []
    for line in section.splitlines():
        if line and not line.startswith(" "):
            break  # the next section
        if match := re.match(r"^    (\w+)(?: \([^)]*\))?:", line):
            names.append(match.group(1))
    return names


@pytest.mark.parametrize("cls", [HybridStrategy, HybridPrecision, ScalingMonitor], ids=lambda c: c.__name__)
def test_every_argument_has_an_args_entry_in_signature_order(cls):
    parameters = [name for name in inspect.signature(cls.__init__).parameters if name != "self"]
    documented = _documented_arguments(cls)
    assert documented == parameters, (
        f"{cls.__name__}: undocumented {sorted(set(parameters) - set(documented))},"
        f" documented but not parameters {sorted(set(documented) - set(parameters))}, or out of order"
    )


def _pages() -> list[Path]:
    return sorted(DOCS.rglob("*.md"))


def test_the_docs_have_their_pages_and_runnable_snippets():
    pages = _pages()
    names = {str(p.relative_to(DOCS)) for p in pages}
    for required in ("index.md", "troubleshooting.md", "benchmarks.md", "reference/api.md", "reference/cli.md"):
        assert required in names, f"docs/{required} is missing"
    assert sum(name.startswith("guides/") for name in names) >= 12
    assert sum(len(_PYTHON_BLOCK.findall(p.read_text())) for p in pages) >= 10, "too few executed snippets"


RUNNER = r"""
import re, sys, traceback, warnings
from pathlib import Path
warnings.simplefilter("ignore")
block = re.compile(sys.argv[1], re.MULTILINE | re.DOTALL)
failures = []
for page in sys.argv[2:]:
    namespace = {"__name__": "__docs__"}
    for i, code in enumerate(block.findall(Path(page).read_text())):
        try:
            exec(compile(code, f"{page} (python block {i + 1})", "exec"), namespace)
        except BaseException:
            failures.append(traceback.format_exc(limit=3))
            break
print("\n".join(failures), file=sys.stderr)
sys.exit(1 if failures else 0)
"""


def test_every_python_snippet_of_the_docs_runs(tmp_path):
    """Each page's ``python`` blocks run in order in one namespace (a tutorial's state carries over); one process
    for all pages, so the imports are paid once."""
    pages = [str(p) for p in _pages() if _PYTHON_BLOCK.search(p.read_text())]
    result = subprocess.run(
        [sys.executable, "-c", RUNNER, _PYTHON_BLOCK.pattern, *pages],
        cwd=tmp_path,  # snippets that write files write them here
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, f"snippets failed:\n{result.stderr[-6000:]}"


def test_the_readme_is_short_starts_with_the_two_commands_and_its_links_resolve():
    readme = (REPO / "README.md").read_text()
    assert len(readme.splitlines()) <= 250
    commands = re.findall(r"^```bash\n(.*?)\n```", readme, re.MULTILINE | re.DOTALL)
    # The demo command is what tests/cli/test_demo.py runs (after the install; slow tier); the test command is what
    # .ci/run runs.
    assert commands[:2] == [
        "pip install torch==2.13.0 -e . && lightning-mgpu demo",
        'pip install torch==2.13.0 -e ".[dev]" && python -m pytest -q',
    ]
    ci_commands = [line.split("#")[0].strip() for line in (REPO / ".ci" / "run").read_text().splitlines()]
    assert "python -m pytest -q" in ci_commands and "python -m pytest -q -m slow" in ci_commands  # both tiers
    for target in re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", readme):
        assert (REPO / target).exists(), f"README links to {target}, which does not exist"


def test_the_lightning_features_page_is_what_its_case_lists_print():
    """docs/guides/lightning-features.md is generated from the conformance suites' own case lists."""
    from tests.helpers.conformance import render_page

    page = DOCS / "guides" / "lightning-features.md"
    assert page.read_text() == render_page(), (
        "docs/guides/lightning-features.md differs from the suites' case lists: regenerate it with"
        " `python -m tests.helpers.conformance > docs/guides/lightning-features.md`"
    )


def _docs_module(name: str):
    """``docs/<name>.py``, imported from its path (the docs folder is no package)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(f"docs_{name}", DOCS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_the_figures_are_what_the_code_draws_now():
    """``docs/figures.py`` draws the SVGs from the code's data: the committed files must be what it draws now (the
    docs build checks the same before building), and the real runs' PNGs must be there."""
    figures = _docs_module("figures")
    assert len(figures.figures()) >= 10
    assert figures.stale() == [], "run `python docs/figures.py` and commit docs/figures/"


_IMAGE = re.compile(r"!\[[^\]]+\]\((\.\./)?figures/([\w.-]+)\)")


def test_every_guide_starts_with_what_a_user_does():
    """A guide's first code block (what you write or run) comes before its second section."""
    for page in sorted((DOCS / "guides").glob("*.md")):
        text = page.read_text()
        first_code = text.find("\n```")
        assert first_code >= 0 and text[:first_code].count("\n## ") <= 1, f"{page.name} opens without code"


def test_the_site_shows_the_figures_each_guide_after_its_code():
    shown = {}
    for page in _pages():
        text = page.read_text()
        for match in _IMAGE.finditer(text):
            shown[match[2]] = page
            assert (DOCS / "figures" / match[2]).is_file(), f"{page.name} shows figures/{match[2]}, which is missing"
        first_image, first_code = text.find("!["), text.find("```")
        if first_image >= 0 and page.parent.name == "guides":
            assert 0 <= first_code < first_image, f"{page.name}: what a user does (code) comes before its picture"
    assert len(shown) >= 6, sorted(shown)
    assert {"mesh.svg", "zero-memory.svg", "tp-split.svg", "scaling_report.png", "bench.png"} <= set(shown)
    assert sum(name.startswith("schedule-") for name in shown) == 7  # every pipeline schedule


def test_the_limitations_page_lists_every_refusal_in_the_code():
    """The page's table is generated from the source (``docs/hooks.py``): it holds one row per ``raise
    NotImplementedError(`` and ``refuse_compositions(`` call that a plain text search finds."""
    hooks = _docs_module("hooks")
    found = hooks.refusals()
    package = REPO / "lightning_mgpu"
    raises = sum(p.read_text().count("raise NotImplementedError(") for p in package.rglob("*.py"))
    calls = sum(len(re.findall(r"(?<!def )\brefuse_compositions\(", p.read_text())) for p in package.rglob("*.py"))
    raised_for_callers = 2  # options.py: refuse_compositions' own raise and check_implemented's (no pending option)
    assert len(found) == raises - raised_for_callers + calls
    assert "<!-- refusals -->" in (DOCS / "limitations.md").read_text()
    table = hooks.on_page_markdown("<!-- refusals -->")
    assert all(refusal.message.replace("|", "\\|") in table for refusal in found)


def test_the_migration_guides_checkpoint_claims_are_each_tested():
    """Every case the guide's checkpoint table names is a test of ``tests/test_migration.py``."""
    guide = (DOCS / "guides" / "migration.md").read_text()
    section = guide.split("## Your checkpoints", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("|")][2:]  # past the header and its rule
    named = {name for row in rows for name in re.findall(r"`([\w-]+)`", row.rsplit("|", 2)[1])}
    tests = (REPO / "tests" / "test_migration.py").read_text()
    assert named and all(re.search(rf'id="{name}"|def {name}\(', tests) for name in named), named
    assert len(rows) == 5  # a DDP file, under a pipeline, ModelParallel's directory, a full file, DeepSpeed's
