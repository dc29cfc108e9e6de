from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(SCRIPTS))

from workspace import ROOT  # noqa: E402


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
