"""Refuse a release tag that does not match the workspace.

    python scripts/check_release.py --tag composer-verl-v0.1.0 [--github-output FILE]
    python scripts/check_release.py --all      # CI: every adapter accepts the workspace's composer-core

A tag ``composer-<pkg>-v<version>`` is accepted when:

* ``<pkg>`` is one of the workspace's distributions and ``<version>`` is exactly the ``version`` of its
  pyproject.toml (bump the pyproject first, then tag);
* the package's CHANGELOG.md has a ``## [<version>]`` section;
* for an adapter: its ``composer-core`` requirement has a version range and that range contains the
  workspace's composer-core version (the adapter was tested against exactly that core);
* for composer-core: every adapter's range contains the new core version (else the workspace itself
  cannot resolve; widen the adapters' ranges in the same change, see CONTRIBUTING.md).

With ``--github-output`` the accepted package is written for the release workflow (``package``,
``short``, ``version``, ``session``). Exit status: 0 accepted, 1 refused (one line per reason), 2 usage.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Sequence
from pathlib import Path

from packaging.requirements import InvalidRequirement, Requirement
from packaging.version import InvalidVersion, Version

sys.path.insert(0, str(Path(__file__).resolve().parent))
from workspace import ROOT, Package, packages

TAG = re.compile(r"composer-(?P<short>[a-z0-9][a-z0-9-]*?)-v(?P<version>[0-9][^\s]*)")
CORE = "composer-core"


def parse_tag(tag: str) -> tuple[str, str]:
    """``composer-prime-rl-v0.1.0`` -> (``composer-prime-rl``, ``0.1.0``); ValueError naming the form."""
    m = TAG.fullmatch(tag.removeprefix("refs/tags/"))
    if not m:
        raise ValueError(
            f"tag {tag!r} is not of the form composer-<pkg>-v<version> (e.g. composer-verl-v0.1.0)"
        )
    return f"composer-{m['short']}", m["version"]


def core_requirement(package: Package) -> Requirement | None:
    for raw in package.project.get("dependencies", []):
        try:
            req = Requirement(raw)
        except InvalidRequirement:
            continue
        if req.name.lower().replace("_", "-") == CORE:
            return req
    return None


def imports_core(package: Package) -> bool:
    """Whether the package's source imports ``composer_core`` (then it must declare a composer-core range)."""
    return any(
        re.search(r"^\s*(from|import)\s+composer_core\b", path.read_text(encoding="utf-8"), re.M)
        for path in package.source.rglob("*.py")
    )


def core_range_problems(package: Package, core_version: str) -> list[str]:
    """Why ``package`` cannot be released against the workspace's composer-core (empty: it can)."""
    req = core_requirement(package)
    if req is None and not imports_core(package):
        return []  # a distribution that does not use composer-core has no range to keep (composer-diloco)
    if req is None:
        return [f"{package.name}: no composer-core dependency in pyproject.toml"]
    if not str(req.specifier):
        return [
            f"{package.name}: composer-core has no version range; declare e.g. 'composer-core>={core_version},<...'"
        ]
    if not req.specifier.contains(Version(core_version), prereleases=True):
        return [
            f"{package.name}: its range 'composer-core{req.specifier}' excludes the workspace's composer-core "
            f"{core_version}; test the adapter against it and widen the range (CONTRIBUTING.md, versioning)"
        ]
    return []


def changelog_problems(package: Package, version: str) -> list[str]:
    changelog = package.directory / "CHANGELOG.md"
    if not changelog.is_file():
        return [f"{package.name}: no CHANGELOG.md"]
    if not re.search(rf"^## \[{re.escape(version)}\]", changelog.read_text(), re.MULTILINE):
        return [
            f"{package.name}: CHANGELOG.md has no '## [{version}]' section; move the Unreleased entries there"
        ]
    return []


def check_tag(tag: str, root: Path = ROOT) -> tuple[Package | None, list[str]]:
    """The package a tag releases and the reasons to refuse it (empty list: accepted)."""
    try:
        name, version = parse_tag(tag)
    except ValueError as e:
        return None, [str(e)]
    workspace = packages(root)
    if name not in workspace:
        return None, [
            f"tag {tag!r} names {name!r}, which is not a workspace package ({', '.join(workspace)})"
        ]
    pkg = workspace[name]
    try:
        Version(version)
    except InvalidVersion:
        return pkg, [f"tag {tag!r}: {version!r} is not a valid version"]
    problems: list[str] = []
    if version != pkg.version:
        problems.append(
            f"tag {tag!r} says {version} but packages/{name}/pyproject.toml says {pkg.version}; "
            f"bump the pyproject (or tag {name}-v{pkg.version})"
        )
    problems += changelog_problems(pkg, pkg.version)
    core_version = workspace[CORE].version
    if name == CORE:
        for other in workspace.values():
            if other.name != CORE:
                problems += core_range_problems(other, core_version)
    else:
        problems += core_range_problems(pkg, core_version)
    return pkg, problems


def check_all(root: Path = ROOT) -> list[str]:
    workspace = packages(root)
    core_version = workspace[CORE].version
    return [
        p for pkg in workspace.values() if pkg.name != CORE for p in core_range_problems(pkg, core_version)
    ]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    what = parser.add_mutually_exclusive_group(required=True)
    what.add_argument("--tag", help="the pushed tag, e.g. composer-verl-v0.1.0 (refs/tags/ prefix allowed)")
    what.add_argument("--all", action="store_true", help="check every adapter's composer-core range")
    parser.add_argument("--github-output", type=Path, help="append package=, short=, version=, session= here")
    parser.add_argument("--root", type=Path, default=ROOT, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.all:
        problems = check_all(args.root)
        for line in problems:
            print(f"check_release: {line}")
        if not problems:
            print("check_release: every adapter's composer-core range contains the workspace's composer-core")
        return 1 if problems else 0
    pkg, problems = check_tag(args.tag, args.root)
    for line in problems:
        print(f"check_release: refused: {line}")
    if problems or pkg is None:
        return 1
    print(f"check_release: {args.tag} releases {pkg.name} {pkg.version}")
    if args.github_output:
        with args.github_output.open("a") as f:
            f.write(
                f"package={pkg.name}\nshort={pkg.short}\nversion={pkg.version}\nsession=tests-{pkg.short}\n"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
