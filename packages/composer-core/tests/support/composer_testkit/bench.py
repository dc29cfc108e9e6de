"""CI's check that a bench script works: run it at ``--small`` in a fresh interpreter, load the JSON it wrote
(one helper for every package's ``tests/test_bench_small.py``; times are never asserted)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = ["load_bench_json", "run_bench", "run_small_bench"]


def run_bench(
    script: Path, out: Path, *args: str, env: dict[str, str] | None = None, timeout: float = 600
) -> subprocess.CompletedProcess[str]:
    """Run ``script args`` in a fresh interpreter with ``$COMPOSER_BENCH_OUT = out`` (plus ``env``); the
    finished process, whatever its exit code. Python may cache bytecode: benches start fresh interpreters
    importing torch."""
    full = {**os.environ, "COMPOSER_BENCH_OUT": str(out), **(env or {})}
    full.pop("PYTHONDONTWRITEBYTECODE", None)
    return subprocess.run(
        [sys.executable, str(script), *args], env=full, capture_output=True, text=True, timeout=timeout
    )


def run_small_bench(
    script: Path,
    out: Path,
    *,
    env: dict[str, str] | None = None,
    timeout: float = 600,
    args: Sequence[str] = (),
) -> None:
    """Run ``script --small [args]`` (see :func:`run_bench`); AssertionError with the output's tail if it
    fails."""
    run = run_bench(script, out, "--small", *args, env=env, timeout=timeout)
    assert run.returncode == 0, (
        f"{script.name} --small exited {run.returncode}:\n{run.stdout[-2000:]}{run.stderr[-3000:]}"
    )


def load_bench_json(path: Path) -> dict[str, Any]:
    """A bench JSON, checked for the project's convention: a ``machine`` block and README table rows."""
    data: dict[str, Any] = json.loads(path.read_text())
    assert data["machine"] and data["readme"]["rows"], f"{path.name} lacks the machine block or README rows"
    return data
