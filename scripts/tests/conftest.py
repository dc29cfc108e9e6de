from __future__ import annotations

import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(SCRIPTS))

from workspace import ROOT, packages  # noqa: E402


@pytest.fixture(scope="session")
def built(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Real wheels and sdists of composer-prime-rl (package data) and composer-verl (an entry point),
    built by uv from the workspace exactly as the release job builds them."""
    uv = shutil.which("uv")
    assert uv, "uv is needed to build the distributions (pip install uv)"
    out = tmp_path_factory.mktemp("dist")
    for name in ("composer-prime-rl", "composer-verl"):
        subprocess.run([uv, "build", "--package", name, "--out-dir", str(out), "-q"], cwd=ROOT, check=True)
    return out


@pytest.fixture
def ws(tmp_path: Path) -> Path:
    """A copy of the workspace's metadata: the root pyproject and README, and each package's pyproject,
    README, CHANGELOG and src (what check_release.py and readme_install.py read), to edit in a test."""
    for leaf in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / leaf, tmp_path / leaf)
    for pkg in packages().values():
        dst = tmp_path / "packages" / pkg.directory.name
        dst.mkdir(parents=True)
        for leaf in ("pyproject.toml", "README.md", "CHANGELOG.md"):
            shutil.copy(pkg.directory / leaf, dst / leaf)
        # the sources: check_release reads whether a package imports composer_core
        shutil.copytree(pkg.directory / "src", dst / "src", ignore=shutil.ignore_patterns("__pycache__"))
    return tmp_path


def _edit(path: Path, old: str, new: str) -> None:
    text = path.read_text()
    assert old in text, (path, old)
    path.write_text(text.replace(old, new, 1))


@pytest.fixture
def edit() -> Callable[[Path, str, str], None]:
    """``edit(path, old, new)``: replace the first ``old`` in ``path`` (which must contain it) with ``new``."""
    return _edit
