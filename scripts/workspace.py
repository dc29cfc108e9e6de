"""The workspace as the release scripts see it: its six distributions and the release settings.

Standard library only (plus ``packaging`` where a script compares versions), so the scripts run in a bare
Python 3.11 (CI runner, release job) without installing the workspace.
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
#: Python versions CI tests; the only ``Programming Language :: Python :: X.Y`` classifiers allowed.
TESTED_PYTHONS = ("3.11",)


@dataclass(frozen=True)
class Package:
    """One distribution under ``packages/``."""

    short: str  # "verl"
    name: str  # "composer-verl"
    version: str
    directory: Path
    import_name: str  # "composer_verl"
    project: dict[str, Any] = field(repr=False)

    @property
    def source(self) -> Path:
        return self.directory / "src" / self.import_name

    @property
    def wheel_stem(self) -> str:
        return f"{self.import_name}-{self.version}"


def root_config(root: Path = ROOT) -> dict[str, Any]:
    """``[tool.composer.release]`` of the root pyproject (``repository``)."""
    data = tomllib.loads((root / "pyproject.toml").read_text())
    config: dict[str, Any] = data["tool"]["composer"]["release"]
    return config


def repository(root: Path = ROOT) -> str:
    return str(root_config(root)["repository"]).rstrip("/")


def load_package(directory: Path) -> Package:
    project = tomllib.loads((directory / "pyproject.toml").read_text())["project"]
    name = project["name"]
    return Package(
        short=name.removeprefix("composer-"),
        name=name,
        version=project["version"],
        directory=directory,
        import_name=name.replace("-", "_"),
        project=project,
    )


def packages(root: Path = ROOT) -> dict[str, Package]:
    """Every distribution of the workspace, by distribution name (``packages/_template``, the adapter
    skeleton, is not a workspace member and not a distribution)."""
    found = [
        load_package(d)
        for d in sorted((root / "packages").iterdir())
        if (d / "pyproject.toml").is_file() and not d.name.startswith("_")
    ]
    return {p.name: p for p in found}
