"""scripts/check_wheels.py against real built distributions and deliberately broken copies of them."""

from __future__ import annotations

import base64
import csv
import hashlib
import io
import re
import shutil
import tarfile
import zipfile
from collections.abc import Callable
from pathlib import Path

import pytest
from check_wheels import check_dist, check_sdist, check_wheel, expected, main
from workspace import packages

PKGS = packages()


def _wheel(dist: Path, name: str) -> Path:
    return next(dist.glob(f"{PKGS[name].wheel_stem}-*.whl"))


def _sdist(dist: Path, name: str) -> Path:
    return dist / f"{PKGS[name].wheel_stem}.tar.gz"


def _hash(data: bytes) -> str:
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def rewrite_wheel(
    src: Path,
    dst: Path,
    edit: Callable[[dict[str, bytes]], None],
    fix_record: bool = True,
) -> Path:
    """Copy a wheel, letting ``edit`` change its {name: bytes}; RECORD is rewritten to match unless
    ``fix_record`` is False (so only the intended defect shows)."""
    with zipfile.ZipFile(src) as zf:
        files = {n: zf.read(n) for n in zf.namelist()}
    edit(files)
    if fix_record:
        record = next(n for n in files if n.endswith(".dist-info/RECORD"))
        buf = io.StringIO()
        writer = csv.writer(buf, lineterminator="\n")
        for name, data in files.items():
            if name != record:
                writer.writerow([name, _hash(data), str(len(data))])
        writer.writerow([record, "", ""])
        files[record] = buf.getvalue().encode()
    dst.parent.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(dst, "w") as zf:
        for name, data in files.items():
            zf.writestr(name, data)
    return dst


def _info(files: dict[str, bytes], leaf: str) -> str:
    return next(n for n in files if n.endswith(f".dist-info/{leaf}"))


def _edit_metadata(files: dict[str, bytes], fn: Callable[[str], str]) -> None:
    name = _info(files, "METADATA")
    files[name] = fn(files[name].decode()).encode()


def test_built_distributions_are_complete(built: Path) -> None:
    assert check_dist(built, ["composer-prime-rl", "composer-verl"]) == []
    assert main([str(built), "--package", "composer-prime-rl", "--package", "composer-verl"]) == 0


def test_wheel_without_the_verl_plugin_entry_point_fails_naming_it(built: Path, tmp_path: Path) -> None:
    def drop(files: dict[str, bytes]) -> None:
        del files[_info(files, "entry_points.txt")]

    broken = rewrite_wheel(
        _wheel(built, "composer-verl"), tmp_path / _wheel(built, "composer-verl").name, drop
    )
    problems = check_wheel(broken, expected(PKGS["composer-verl"]))
    assert len(problems) == 1
    assert "no entry_points.txt" in problems[0] and "verl.plugins" in problems[0]

    def rename(files: dict[str, bytes]) -> None:
        name = _info(files, "entry_points.txt")
        files[name] = files[name].replace(b"composer = ", b"composr = ")

    broken = rewrite_wheel(
        _wheel(built, "composer-verl"), tmp_path / "x" / _wheel(built, "composer-verl").name, rename
    )
    (problem,) = check_wheel(broken, expected(PKGS["composer-verl"]))
    assert "entry point [verl.plugins] 'composer' missing" in problem


@pytest.mark.parametrize("leaf", ["examples/rl.toml", "examples/trainer.toml", "py.typed", "loss.py"])
def test_wheel_missing_package_data_fails_naming_the_file(built: Path, tmp_path: Path, leaf: str) -> None:
    wheel = _wheel(built, "composer-prime-rl")
    broken = rewrite_wheel(wheel, tmp_path / wheel.name, lambda f: f.pop(f"composer_prime_rl/{leaf}"))
    (problem,) = check_wheel(broken, expected(PKGS["composer-prime-rl"]))
    assert f"composer_prime_rl/{leaf} is missing" in problem


def test_wheel_without_license_file_fails(built: Path, tmp_path: Path) -> None:
    wheel = _wheel(built, "composer-prime-rl")

    def drop(files: dict[str, bytes]) -> None:
        del files[_info(files, "licenses/LICENSE")]
        _edit_metadata(files, lambda m: m.replace("License-File: LICENSE\n", ""))

    problems = check_wheel(
        rewrite_wheel(wheel, tmp_path / wheel.name, drop), expected(PKGS["composer-prime-rl"])
    )
    assert any("no License-File: LICENSE" in p for p in problems)
    assert any("licenses/LICENSE" in p and "license-files" in p for p in problems)
    assert len(problems) == 2


@pytest.mark.parametrize(
    ("edit", "needle"),
    [
        (lambda m: m.replace("Classifier: Typing :: Typed\n", ""), "no classifier 'Typing :: Typed'"),
        (
            lambda m: m.replace(
                "Classifier: Programming Language :: Python :: 3.11\n",
                "Classifier: Programming Language :: Python :: 3.11\nClassifier: Programming Language :: Python :: 3.13\n",
            ),
            "3.13' but CI tests only 3.11",
        ),
        (lambda m: m.replace("Classifier: Programming Language :: Python :: 3.11\n", ""), "a tested version"),
        (lambda m: re.sub(r"Project-URL: Changelog, .*\n", "", m), "no Project-URL 'Changelog'"),
        (lambda m: m.replace("Requires-Python: >=3.11\n", ""), "no Requires-Python"),
        (
            lambda m: re.sub(r"Requires-Dist: composer-core[^\n]*\n", "", m),
            "'composer-core' of pyproject.toml",
        ),
        (
            lambda m: m.replace("# composer-prime-rl", "# something else"),
            "long description is not the package README",
        ),
        (lambda m: m.replace("Version: 0.1.0", "Version: 9.9.9"), "Version is '9.9.9'"),
    ],
)
def test_wheel_metadata_defects_are_named(
    built: Path, tmp_path: Path, edit: Callable[[str], str], needle: str
) -> None:
    wheel = _wheel(built, "composer-prime-rl")
    broken = rewrite_wheel(wheel, tmp_path / wheel.name, lambda f: _edit_metadata(f, edit))
    problems = check_wheel(broken, expected(PKGS["composer-prime-rl"]))
    assert len(problems) == 1 and needle in problems[0], problems


def test_record_must_match_the_archive(built: Path, tmp_path: Path) -> None:
    wheel = _wheel(built, "composer-prime-rl")

    def tamper(files: dict[str, bytes]) -> None:
        files["composer_prime_rl/loss.py"] += b"\n# tampered\n"
        files["composer_prime_rl/extra.py"] = b""

    broken = rewrite_wheel(wheel, tmp_path / wheel.name, tamper, fix_record=False)
    problems = check_wheel(broken, expected(PKGS["composer-prime-rl"]))
    text = "\n".join(problems)
    assert "RECORD hash of composer_prime_rl/loss.py" in text
    assert "composer_prime_rl/extra.py is not listed in RECORD" in text
    assert "composer_prime_rl/loss.py differs from the source tree" in text


def test_sdist_without_changelog_or_license_fails(built: Path, tmp_path: Path) -> None:
    src = _sdist(built, "composer-verl")
    dst = tmp_path / src.name
    with tarfile.open(src) as tin, tarfile.open(dst, "w:gz") as tout:
        for m in tin.getmembers():
            if m.name.endswith(("/CHANGELOG.md", "/LICENSE")):
                continue
            tout.addfile(m, tin.extractfile(m) if m.isfile() else None)
    problems = check_sdist(dst, expected(PKGS["composer-verl"]))
    assert sorted(problems) == [
        f"{dst.name}: CHANGELOG.md is missing from the sdist",
        f"{dst.name}: LICENSE is missing from the sdist",
    ]


def test_cli_exit_codes_and_missing_distributions(
    built: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    only = tmp_path / "only-wheel"
    only.mkdir()
    shutil.copy(_wheel(built, "composer-verl"), only)
    assert main([str(only), "--package", "composer-verl"]) == 1
    out = capsys.readouterr().out
    assert "expected one sdist composer_verl-0.1.0.tar.gz, found 0" in out
    assert "uv build --package composer-verl" in out
    assert main([str(tmp_path / "nope")]) == 2
    assert main([str(only), "--package", "composer-nope"]) == 2
