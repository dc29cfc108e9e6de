"""Shared head of every smoke script (``nox -s installed`` writes it in front of the package's script and
runs the result with the fresh venv's ``python -I`` from a temporary directory: nothing from the repository
is importable, only what the built wheels and the package index installed)."""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
import sysconfig
from importlib import metadata
from pathlib import Path

SITE = Path(sysconfig.get_paths()["purelib"]).resolve()
BIN = Path(sys.executable).parent
WORK = Path.cwd()


def installed_from_wheel(dist: str, module: str) -> None:
    """``dist`` was installed from a built wheel (not a directory, not editable) and ``module`` is
    imported from the venv's site-packages."""
    info = json.loads(metadata.distribution(dist).read_text("direct_url.json") or "{}")
    url = info.get("url", "")
    assert url.endswith(".whl") and "dir_info" not in info, (
        f"{dist} was not installed from a built wheel: {info}"
    )
    mod = importlib.import_module(module)
    where = Path(mod.__file__ or "").resolve()
    assert where.is_relative_to(SITE), f"{module} imported from {where}, not from the venv {SITE}"
    print(f"ok: {dist} {metadata.version(dist)} installed from {Path(url).name}")


def run(*cmd: str | Path, timeout: float = 600, env: dict[str, str] | None = None) -> str:
    """Run a command of the venv, fail with its output tail."""
    proc = subprocess.run(
        [str(c) for c in cmd],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"{' '.join(map(str, cmd))} exited {proc.returncode}:\n{out[-4000:]}"
    return out


# ---- package smoke checks below ----
