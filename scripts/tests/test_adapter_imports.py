"""Adapters call composer_core's public names only (issue 51, "one seam").

Every ``import`` of ``composer_core`` in an adapter's ``src`` (every distribution but composer-core, and the
``packages/_template`` skeleton) is read with :mod:`ast`: a leading-underscore module on the path
(``composer_core.loss._x``) or a leading-underscore name imported from it (``from composer_core.loss.policy
import _helper``), or an attribute access such as ``composer_core._x`` / ``policy._x`` on a module imported
from core, fails the test, naming file and line.
A private name core needs is core's business; what an adapter needs gets a public name with a docstring.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from workspace import ROOT, packages

CORE = "composer_core"


def _private(part: str) -> bool:
    return part.startswith("_") and not (part.startswith("__") and part.endswith("__"))


def _core_module(name: str | None) -> bool:
    return name is not None and (name == CORE or name.startswith(CORE + "."))


def private_core_imports(path: Path) -> list[str]:
    """``file:line: what`` for each private composer_core name ``path`` imports or reads off a core module."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    where = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
    found: list[str] = []
    aliases: set[str] = set()  # local names bound to a composer_core module (or the package)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if not _core_module(alias.name):
                    continue
                if any(_private(p) for p in alias.name.split(".")):
                    found.append(f"{where}:{node.lineno}: import {alias.name}")
                aliases.add(alias.asname or CORE)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and _core_module(node.module):
            assert node.module is not None
            if any(_private(p) for p in node.module.split(".")):
                found.append(f"{where}:{node.lineno}: from {node.module} import ...")
                continue
            for alias in node.names:
                if _private(alias.name):
                    found.append(f"{where}:{node.lineno}: from {node.module} import {alias.name}")
                else:  # may be a submodule (from composer_core.loss import policy): watch its attributes
                    aliases.add(alias.asname or alias.name)
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _private(node.attr):
            base = node.value
            while isinstance(base, ast.Attribute):
                if _private(base.attr):
                    break
                base = base.value
            if isinstance(base, ast.Name) and base.id in aliases:
                found.append(f"{where}:{node.lineno}: {ast.unparse(node)}")
    return sorted(set(found), key=lambda s: (s.split(":")[0], int(s.split(":")[1])))


#: every adapter's src by distribution name, and the skeleton a new adapter is copied from
ADAPTERS = {name: pkg.directory / "src" for name, pkg in packages().items() if name != "composer-core"}
ADAPTERS["_template"] = ROOT / "packages" / "_template" / "src"


def test_there_are_adapters_to_check() -> None:
    assert {"composer-trl", "composer-verl", "composer-prime-rl", "_template"} <= set(ADAPTERS)
    assert all(src.is_dir() for src in ADAPTERS.values())


@pytest.mark.parametrize("name", sorted(ADAPTERS))
def test_adapter_imports_public_core_names_only(name: str) -> None:
    src = ADAPTERS[name]
    found = [hit for path in sorted(src.rglob("*.py")) for hit in private_core_imports(path)]
    assert not found, (
        f"{name} reaches into composer_core's private names (give core a public name with a docstring, "
        "then import that):\n  " + "\n  ".join(found)
    )


@pytest.mark.parametrize(
    ("source", "hits"),
    [
        ("from composer_core.loss.policy import _surrogate_from_ratio\n", 1),
        ("from composer_core.loss.distill import full_precision, _sampled_token_distill as k\n", 1),
        ("from composer_core.loss._kernels import anything\n", 1),
        ("import composer_core._internal\n", 1),
        ("import composer_core\nx = composer_core.loss.policy._aggregate\n", 1),
        ("from composer_core.loss import policy as p\nx = p._aggregate\n", 1),
        ("from composer_core.loss.policy import clipped_surrogate\nimport os\nos._exit\n", 0),
        ("from composer_core.loss.validation import host_reads_are_free as _free\n", 0),
        ("import composer_core\nv = composer_core.__version__\n", 0),
        ("from .loss import _local\nfrom composer_corex import _y\n", 0),
    ],
)
def test_the_walk_finds_private_imports(tmp_path: Path, source: str, hits: int) -> None:
    path = tmp_path / "m.py"
    path.write_text(source)
    found = private_core_imports(path)
    assert len(found) == hits, found
    assert all(hit.startswith(f"{path}:") for hit in found)
