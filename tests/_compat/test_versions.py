"""The import-time version guard: tested releases pass, an older or another minor one is refused by name."""

import pytest

from lightning_mgpu._compat import CHECKED, versions


def test_installed_versions_are_the_tested_ones():
    versions.check_versions()  # what `import lightning_mgpu` ran already; the suite runs on the tested releases


@pytest.mark.parametrize(
    ("installed", "accepted"),
    [("2.13.0+cpu", True), ("2.13.2", True), ("2.12.1", False), ("2.14.0", False), ("not installed", False)],
)
def test_torch_releases(monkeypatch, installed, accepted):
    monkeypatch.delenv(versions.SKIP_VARIABLE, raising=False)
    monkeypatch.setitem(CHECKED, "torch", "2.13.0")
    monkeypatch.setattr(
        versions, "installed_version", lambda package: installed if package == "torch" else CHECKED[package]
    )
    if accepted:
        versions.check_versions()
        return
    with pytest.raises(
        ImportError, match=rf"installed torch {installed} \(tested: 2\.13\.0, supported: >=2\.13\.0,<2\.14\)"
    ):
        versions.check_versions()
    monkeypatch.setenv(versions.SKIP_VARIABLE, "1")
    versions.check_versions()


def test_message_names_the_fix(monkeypatch):
    monkeypatch.delenv(versions.SKIP_VARIABLE, raising=False)
    monkeypatch.setattr(versions, "installed_version", lambda package: "0.1")
    with pytest.raises(ImportError) as error:
        versions.check_versions()
    for package, checked in CHECKED.items():
        assert f"{package} 0.1 (tested: {checked}" in str(error.value)
    assert "pip install 'torch>=" in str(error.value) and versions.SKIP_VARIABLE in str(error.value)
