"""CONTRIBUTING's "Adding an adapter", step 1, done for real: this skeleton copied as a new adapter
(``composer-demohost`` / ``composer_demohost``) with every name replaced, and the copy's own conformance suite run
against the copy's source in a fresh interpreter. Delete this file in your copy (it tests the skeleton itself)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

SKELETON = Path(__file__).resolve().parents[1]


def _copy_as(dest: Path, host: str) -> Path:
    root = dest / f"composer-{host}"
    shutil.copytree(
        SKELETON, root, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info", ".pytest_cache")
    )
    (root / "src" / "composer_adapter").rename(root / "src" / f"composer_{host}")
    for path in root.rglob("*"):
        if path.is_file() and path.suffix in (".py", ".toml", ".md"):
            text = path.read_text(encoding="utf-8")
            text = text.replace("composer_adapter", f"composer_{host}").replace(
                "composer-adapter", f"composer-{host}"
            )
            path.write_text(text.replace("<host>", host), encoding="utf-8")
    return root


def test_a_copy_renamed_as_a_new_adapter_passes_its_conformance_suite(tmp_path: Path) -> None:
    root = _copy_as(tmp_path, "demohost")
    leftovers = [
        p for p in root.rglob("*") if p.is_file() and "composer_adapter" in p.read_text(errors="ignore")
    ]
    assert leftovers == [], leftovers
    env = {**os.environ, "PYTHONPATH": str(root / "src")}
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(root / "tests" / "test_conformance.py")],
        cwd=root, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "1 passed" in run.stdout
    import_check = subprocess.run(
        [sys.executable, "-c", "import composer_demohost as m; print(m.__file__)"],
        env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert str(root / "src" / "composer_demohost") in import_check.stdout  # the copy ran, not the skeleton
