"""scripts/cuda_checks.sh refuses to start, with one line and its documented exit code, where it cannot run:
2 when $PYTHON cannot import torch, 1 when torch sees no CUDA device (CI's case). Nothing is written then."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "cuda_checks.sh"


def _run(python: str, out: Path, pythonpath: Path | None = None) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHON": python, "OUT": str(out)}
    env.pop("PYTHONPATH", None)
    if pythonpath is not None:
        env["PYTHONPATH"] = str(pythonpath)
    return subprocess.run(["bash", str(SCRIPT)], env=env, capture_output=True, text=True, timeout=120)


def test_a_python_without_torch_exits_2_naming_the_variable(tmp_path: Path) -> None:
    res = _run("false", tmp_path / "out")
    assert res.returncode == 2, res.stderr
    assert "cannot import torch: set PYTHON" in res.stderr
    assert not any((tmp_path / "out").iterdir())


def test_no_cuda_device_exits_1_before_any_step(tmp_path: Path) -> None:
    """A stand-in ``torch`` whose ``cuda.is_available()`` is False (this session may have no torch, or a GPU)."""
    fake = tmp_path / "fake" / "torch"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("class cuda:\n    is_available = staticmethod(lambda: False)\n")
    res = _run(sys.executable, tmp_path / "out", pythonpath=fake.parent)
    assert res.returncode == 1, res.stderr
    assert res.stderr.strip().splitlines()[-1] == "cuda_checks.sh: torch sees no CUDA device"
    assert not any((tmp_path / "out").iterdir())


def test_composer_not_installed_exits_2_naming_the_install(tmp_path: Path) -> None:
    """A stand-in ``torch`` that sees a device, and a ``$PYTHON`` in which composer-core is not installed: the
    sources on PYTHONPATH alone cannot import (composer_core reads its version from the installed distribution),
    so the script stops before any step with the pip command. ``-S`` keeps this test's own site-packages out."""
    fake = tmp_path / "fake" / "torch"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("class cuda:\n    is_available = staticmethod(lambda: True)\n")
    python = tmp_path / "python-S"
    python.write_text(f'#!/bin/sh\nexec "{sys.executable}" -S "$@"\n')
    python.chmod(0o755)
    res = _run(str(python), tmp_path / "out", pythonpath=fake.parent)
    assert res.returncode == 2, res.stderr
    assert "composer-core, composer-prime-rl, composer-trl and composer-diloco" in res.stderr
    assert (
        "pip install --no-deps ./packages/composer-core ./packages/composer-prime-rl ./packages/composer-trl"
        " ./packages/composer-diloco" in res.stderr
    )
    assert len(res.stderr.strip().splitlines()) == 1
    assert not any((tmp_path / "out").iterdir())
