"""scripts/check_release.py on the real workspace and on edited copies of it."""

from __future__ import annotations

from pathlib import Path

import pytest
from check_release import check_all, check_tag, main, parse_tag
from workspace import packages


def test_parse_tag() -> None:
    assert parse_tag("composer-prime-rl-v0.1.0") == ("composer-prime-rl", "0.1.0")
    assert parse_tag("refs/tags/composer-verl-v1.2.3rc1") == ("composer-verl", "1.2.3rc1")
    for bad in ("composer-verl-0.1.0", "verl-v0.1.0", "composer-verl-v", "v0.1.0"):
        with pytest.raises(ValueError, match="composer-<pkg>-v<version>"):
            parse_tag(bad)


@pytest.mark.parametrize("name", sorted(packages()))
def test_every_package_is_releasable_at_its_current_version(name: str) -> None:
    pkg = packages()[name]
    assert check_tag(f"{name}-v{pkg.version}") == (pkg, [])


def test_tag_version_differing_from_pyproject_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    pkg, problems = check_tag("composer-verl-v0.1.1")
    assert pkg is not None and pkg.name == "composer-verl"
    assert problems == [
        "tag 'composer-verl-v0.1.1' says 0.1.1 but packages/composer-verl/pyproject.toml says 0.1.0; "
        "bump the pyproject (or tag composer-verl-v0.1.0)"
    ]
    assert main(["--tag", "composer-verl-v0.1.1"]) == 1
    assert "refused" in capsys.readouterr().out
    # "0.1" is the same version numerically, but the tag must spell the pyproject's version
    assert check_tag("composer-verl-v0.1")[1][0].startswith("tag 'composer-verl-v0.1' says 0.1 ")


def test_unknown_package_and_bad_version_are_refused() -> None:
    assert "not a workspace package" in check_tag("composer-torchtitan-v0.1.0")[1][0]
    assert "not a valid version" in check_tag("composer-verl-v0.1.x")[1][0]
    assert main(["--tag", "nonsense"]) == 1


def test_adapter_whose_core_range_excludes_the_workspace_core_is_refused(ws: Path, edit) -> None:
    edit(ws / "packages/composer-core/pyproject.toml", 'version = "0.1.0"', 'version = "0.2.0"')
    edit(ws / "packages/composer-core/CHANGELOG.md", "## [0.1.0]", "## [0.2.0]")
    _, problems = check_tag("composer-trl-v0.1.0", root=ws)
    assert problems == [
        "composer-trl: its range 'composer-core<0.2,>=0.1.0' excludes the workspace's composer-core 0.2.0; "
        "test the adapter against it and widen the range (CONTRIBUTING.md, versioning)"
    ]
    # releasing that core is refused too, naming every adapter that would no longer resolve
    _, core_problems = check_tag("composer-core-v0.2.0", root=ws)
    # the four adapters that use composer-core (composer-diloco imports nothing from it: no range to keep)
    assert len(core_problems) == 4 and all(
        "excludes the workspace's composer-core 0.2.0" in p for p in core_problems
    )
    assert not any(p.startswith("composer-diloco") for p in core_problems)
    assert len(check_all(ws)) == 4
    assert main(["--all", "--root", str(ws)]) == 1
    # widening one adapter's range (after testing it) makes that adapter releasable
    edit(
        ws / "packages/composer-trl/pyproject.toml",
        '"composer-core>=0.1.0,<0.2"',
        '"composer-core>=0.2.0,<0.3"',
    )
    assert check_tag("composer-trl-v0.1.0", root=ws)[1] == []


def test_adapter_without_a_core_range_is_refused(ws: Path, edit) -> None:
    """verl imports composer_core, so it must declare a range; a package importing nothing from it need not."""
    edit(ws / "packages/composer-verl/pyproject.toml", '"composer-core>=0.1.0,<0.2"', '"composer-core"')
    assert "composer-core has no version range" in check_tag("composer-verl-v0.1.0", root=ws)[1][0]
    edit(ws / "packages/composer-verl/pyproject.toml", '"composer-core",', "")
    assert check_tag("composer-verl-v0.1.0", root=ws)[1] == [
        "composer-verl: no composer-core dependency in pyproject.toml"
    ]


def test_changelog_needs_a_section_for_the_released_version(ws: Path, edit) -> None:
    edit(ws / "packages/composer-monarch/CHANGELOG.md", "## [0.1.0]", "## [0.0.9]")
    assert check_tag("composer-monarch-v0.1.0", root=ws)[1] == [
        "composer-monarch: CHANGELOG.md has no '## [0.1.0]' section; move the Unreleased entries there"
    ]


def test_github_output_names_the_package_and_its_sessions(tmp_path: Path) -> None:
    out = tmp_path / "gh"
    assert main(["--tag", "refs/tags/composer-prime-rl-v0.1.0", "--github-output", str(out)]) == 0
    assert out.read_text().splitlines() == [
        "package=composer-prime-rl",
        "short=prime-rl",
        "version=0.1.0",
        "session=tests-prime-rl",
    ]


def test_workspace_adapters_accept_its_core() -> None:
    assert check_all() == []
    assert main(["--all"]) == 0
