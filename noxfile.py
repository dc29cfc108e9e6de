"""Nox sessions for the composer monorepo.

``nox`` with no arguments runs every package's test session plus lint and typecheck.
Each ``tests-<pkg>`` session installs only that package, ``composer-core`` (for adapters)
and the package's own ``test`` extra into a fresh venv: a missing dependency in a
package's metadata fails its session.

Torch: when pip is configured with a local find-links directory holding a torch wheel
(``PIP_FIND_LINKS``, e.g. a CPU build), every session pins torch to that exact wheel and
never downloads another build. uv ignores pip's configuration, so the noxfile forwards it
as ``UV_FIND_LINKS`` plus a constraint. On an ordinary machine torch comes from the index.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import nox

ROOT = Path(__file__).parent
PACKAGES = ["core", "trl", "verl", "prime-rl", "monarch", "diloco"]

nox.options.default_venv_backend = "uv|virtualenv"
nox.options.reuse_existing_virtualenvs = True
nox.options.sessions = [
    *(f"tests-{p}" for p in PACKAGES),
    "tests-core-extras",
    "tests-core-datajuicer",
    "lint",
    "typecheck",
]


def _local_torch() -> tuple[list[str], str | None]:
    """Return (find-links dirs, exact torch version) from pip's find-links, if any."""
    raw = os.environ.get("UV_FIND_LINKS") or os.environ.get("PIP_FIND_LINKS") or ""
    dirs: list[str] = []
    version: str | None = None
    for entry in raw.replace(",", " ").split():
        path = Path(entry.removeprefix("file://"))
        if not path.is_dir():
            continue
        dirs.append(str(path))
        for wheel in sorted(path.glob("torch-*.whl")):
            m = re.match(r"torch-([^-]+)-", wheel.name)
            if m:
                version = m.group(1)
    return dirs, version


def _prepare(session: nox.Session) -> list[str]:
    """Set up find-links and return extra install args pinning torch (if a local wheel exists)."""
    dirs, version = _local_torch()
    args: list[str] = []
    if dirs:
        session.env["UV_FIND_LINKS"] = " ".join(dirs)
        session.env["PIP_FIND_LINKS"] = " ".join(dirs)
    if version:
        constraints = Path(session.create_tmp()) / "torch-constraint.txt"
        constraints.write_text(f"torch=={version}\n")
        args += ["-c", str(constraints)]
        session.env["UV_CONSTRAINT"] = str(constraints)
        session.env["PIP_CONSTRAINT"] = str(constraints)
    return args


def _pkg(name: str) -> str:
    return str(ROOT / "packages" / f"composer-{name}")


def _install(session: nox.Session, *specs: str) -> None:
    pin = _prepare(session)
    refresh: list[str] = []
    if session.venv_backend == "uv":
        # Local directories are rebuilt every time (uv otherwise caches a build keyed on
        # pyproject.toml only, which would test stale sources).
        for p in PACKAGES:
            refresh += ["--refresh-package", f"composer-{p}", "--reinstall-package", f"composer-{p}"]
    session.install(*pin, *refresh, *specs)


def _install_package(session: nox.Session, name: str, extra: str = "test") -> None:
    specs = [f"{_pkg(name)}[{extra}]" if extra else _pkg(name)]
    if name != "core":
        specs.insert(0, _pkg("core"))
    _install(session, *specs)


def _pytest(session: nox.Session, name: str) -> None:
    session.chdir(_pkg(name))
    session.run("pytest", "tests", *session.posargs)


@nox.session(name="tests-core")
def tests_core(session: nox.Session) -> None:
    """composer-core with nothing but torch (+ its test tools)."""
    _install_package(session, "core")
    session.chdir(_pkg("core"))
    session.run("pytest", "tests", "--ignore=tests/extras", "--ignore=tests/datajuicer", *session.posargs)


@nox.session(name="tests-core-extras")
def tests_core_extras(session: nox.Session) -> None:
    """composer-core features that need its optional extras (tests/extras/)."""
    _install(session, f"{_pkg('core')}[test,all]")
    session.chdir(_pkg("core"))
    session.run("pytest", "tests/extras", *session.posargs)


@nox.session(name="tests-core-datajuicer")
def tests_core_datajuicer(session: nox.Session) -> None:
    """composer-core's py-data-juicer integration against the real library (tests/datajuicer/)."""
    _install(session, f"{_pkg('core')}[test,datajuicer]")
    session.chdir(_pkg("core"))
    session.run("pytest", "tests/datajuicer", *session.posargs)


@nox.session(name="tests-trl")
def tests_trl(session: nox.Session) -> None:
    """composer-trl against the real trl / transformers / datasets / peft."""
    _install_package(session, "trl")
    _pytest(session, "trl")


@nox.session(name="tests-verl")
def tests_verl(session: nox.Session) -> None:
    """composer-verl against the real verl (plus the deps verl forgets to declare)."""
    _install_package(session, "verl")
    _pytest(session, "verl")


@nox.session(name="tests-prime-rl")
def tests_prime_rl(session: nox.Session) -> None:
    """composer-prime-rl (prime-rl itself is not on the package index)."""
    _install_package(session, "prime-rl")
    _pytest(session, "prime-rl")


@nox.session(name="tests-monarch")
def tests_monarch(session: nox.Session) -> None:
    """composer-monarch against the real torchmonarch."""
    _install_package(session, "monarch")
    _pytest(session, "monarch")


@nox.session(name="tests-diloco")
def tests_diloco(session: nox.Session) -> None:
    """composer-diloco against real torchft, fsspec/s3fs, moto's server and ray."""
    _install_package(session, "diloco")
    _pytest(session, "diloco")


@nox.session
def lint(session: nox.Session) -> None:
    """ruff check + ruff format --check over the whole tree."""
    session.install("ruff>=0.8")
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")


@nox.session
def typecheck(session: nox.Session) -> None:
    """mypy --strict on composer-core."""
    _install(session, f"{_pkg('core')}[test]", "mypy>=1.13")
    session.run("mypy", "--strict", str(ROOT / "packages/composer-core/src/composer_core"))


@nox.session
@nox.parametrize("package", [p for p in PACKAGES if (ROOT / "packages" / f"composer-{p}" / "bench").is_dir()])
def bench(session: nox.Session, package: str) -> None:
    """Benchmark scripts (packages/<pkg>/bench/*.py): print side-by-side ratios, write JSON."""
    _install_package(session, package, extra="bench")
    out = ROOT / "bench-results"
    out.mkdir(exist_ok=True)
    session.env["COMPOSER_BENCH_OUT"] = str(out)
    for script in sorted((ROOT / "packages" / f"composer-{package}" / "bench").glob("bench_*.py")):
        session.run("python", str(script), *session.posargs)


@nox.session
def demo(session: nox.Session) -> None:
    """The main job (README's first command)."""
    _install_package(session, "core", extra="")
    session.run("python", "-m", "composer_core.demo", *session.posargs)
