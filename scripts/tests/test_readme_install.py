"""scripts/readme_install.py: the READMEs' install blocks, checked and translated for nox -s installed."""

from __future__ import annotations

from pathlib import Path

from readme_install import check_readme, install_test_commands, main
from workspace import load_package, packages

REPO = "https://github.com/composer-rl/composer"


def test_workspace_readmes_are_consistent() -> None:
    assert main([]) == 0
    for pkg in packages().values():
        assert check_readme(pkg) == [], pkg.name


def test_install_test_commands_point_at_the_built_wheels(tmp_path: Path) -> None:
    wheels = {
        "composer-core": tmp_path / "composer_core-0.1.0-py3-none-any.whl",
        "composer-trl": tmp_path / "composer_trl-0.1.0-py3-none-any.whl",
    }
    (cmd,) = install_test_commands(packages()["composer-trl"], wheels)
    assert cmd == [
        f"composer-core @ {wheels['composer-core'].as_uri()}",
        f"composer-trl[plot] @ {wheels['composer-trl'].as_uri()}",
    ]


def test_a_missing_block_or_a_wrong_git_url_is_reported(ws: Path, edit) -> None:
    readme = ws / "packages/composer-verl/README.md"
    edit(readme, "```bash install-index", "```bash")
    problems = check_readme(load_package(ws / "packages/composer-verl"), ws)
    assert "no ```bash install-index block" in problems[0]
    assert any("installs composer-verl from the index" in p for p in problems)

    edit(readme, "```bash\npip install composer-verl", "```bash install-index\npip install composer-verl")
    edit(readme, "#subdirectory=packages/composer-verl", "#subdirectory=packages/composer-vrl")
    problems = check_readme(load_package(ws / "packages/composer-verl"), ws)
    assert "subdirectory packages/composer-vrl has no pyproject.toml" in problems[0]

    edit(readme, "#subdirectory=packages/composer-vrl", "#subdirectory=packages/composer-trl")
    problems = check_readme(load_package(ws / "packages/composer-verl"), ws)
    assert "holds composer-trl, not composer-verl" in problems[0]

    edit(
        readme,
        f"composer-verl @ git+{REPO}#subdirectory=packages/composer-trl",
        "composer-verl @ git+https://example.com/x#subdirectory=packages/composer-verl",
    )
    problems = check_readme(load_package(ws / "packages/composer-verl"), ws)
    assert f"the repository is {REPO}" in problems[0]


def test_clone_and_git_forms_must_install_the_same(ws: Path, edit) -> None:
    readme = ws / "packages/composer-trl/README.md"
    edit(readme, "'./packages/composer-trl[plot]'", "./packages/composer-trl")
    problems = check_readme(load_package(ws / "packages/composer-trl"), ws)
    assert any(
        "install-git block installs composer-core, composer-trl[openenv], composer-trl[plot]" in p
        for p in problems
    )
    assert any("install-index block does not install composer-trl" in p for p in problems)
    edit(
        readme,
        "pip install ./packages/composer-core ./packages/composer-trl",
        "pip install ./packages/composer-trl",
    )
    problems = check_readme(load_package(ws / "packages/composer-trl"), ws)
    assert any("must install ./packages/composer-core too" in p for p in problems)


def test_clone_path_that_does_not_exist_is_reported(ws: Path, edit) -> None:
    edit(
        ws / "packages/composer-diloco/README.md", "./packages/composer-diloco ", "./packages/composer-dilco "
    )
    problems = check_readme(load_package(ws / "packages/composer-diloco"), ws)
    assert any("packages/composer-dilco has no pyproject.toml" in p for p in problems)


def test_unlabelled_index_install_in_the_root_readme_fails(ws: Path) -> None:
    (ws / "README.md").write_text(
        (ws / "README.md").read_text() + "\n```bash\npip install composer-verl\n```\n"
    )
    assert main([str(ws)]) == 1


def test_clone_command_that_ci_does_not_run_is_reported(ws: Path) -> None:
    # e.g. a README advertising an extra that no install-test block installs
    (ws / "README.md").write_text(
        (ws / "README.md").read_text() + "\nRun `pip install './packages/composer-diloco[ray]'`.\n"
    )
    assert main([str(ws)]) == 1
    readme = ws / "packages/composer-verl/README.md"
    (readme).write_text(readme.read_text() + "\n```bash\npip install ./packages/composer-verl\n```\n")
    problems = check_readme(load_package(ws / "packages/composer-verl"), ws)
    assert any(
        "'pip install ./packages/composer-verl' is not one of the install-test commands" in p
        for p in problems
    )


def test_unknown_extra_is_reported(ws: Path, edit) -> None:
    # pip and uv only warn about an extra the package does not have; the check fails on it
    edit(
        ws / "packages/composer-trl/README.md",
        "'./packages/composer-trl[plot]'",
        "'./packages/composer-trl[plott]'",
    )
    problems = check_readme(load_package(ws / "packages/composer-trl"), ws)
    assert any("composer-trl has no extra plott" in p for p in problems)


def test_named_install_test_blocks_get_their_own_commands(tmp_path: Path) -> None:
    # composer-trl's [verifiers] extra cannot share a venv with [openenv]: each is a named block, its own venv
    from readme_install import install_test_names

    pkg = packages()["composer-trl"]
    wheels = {
        n: tmp_path / f"{n.replace('-', '_')}-0.1.0-py3-none-any.whl"
        for n in ("composer-core", "composer-trl")
    }
    assert install_test_names(pkg) == ["openenv", "smollm2", "verifiers"]
    (cmd,) = install_test_commands(pkg, wheels, name="verifiers")
    assert cmd == [
        f"composer-core @ {wheels['composer-core'].as_uri()}",
        f"composer-trl[verifiers] @ {wheels['composer-trl'].as_uri()}",
    ]
    assert len(install_test_commands(pkg, wheels)) == 1  # the main block is unchanged


def test_named_block_must_install_core_and_its_git_form_must_match(ws: Path, edit) -> None:
    readme = ws / "packages/composer-trl/README.md"
    edit(
        readme,
        "pip install ./packages/composer-core './packages/composer-trl[verifiers]'",
        "pip install './packages/composer-trl[verifiers]'",
    )
    problems = check_readme(load_package(ws / "packages/composer-trl"), ws)
    assert any(
        "install-test block 'verifiers' (its own venv) does not install composer-core" in p for p in problems
    )
    edit(
        readme,
        "pip install './packages/composer-trl[verifiers]'",
        "pip install ./packages/composer-core './packages/composer-trl[verifiers,yaml]'",
    )
    problems = check_readme(load_package(ws / "packages/composer-trl"), ws)
    assert any("make them the same" in p for p in problems), problems
