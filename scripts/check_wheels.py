"""Check the built distributions (wheel + sdist) of composer's packages for everything a user's install needs.

    python scripts/check_wheels.py DIST_DIR [--package composer-verl ...]

For each package (all six unless ``--package`` names some) DIST_DIR must hold exactly one wheel and one
sdist of the workspace's version. The wheel is read as an archive (zip + METADATA + entry_points.txt +
RECORD + WHEEL), never installed. What is checked, from the package's own pyproject.toml and source tree
plus :data:`REQUIRED` (what must never silently disappear from a pyproject):

* METADATA: name, version, summary, ``Requires-Python``, ``Requires-Dist`` as declared; the README as
  long description (``text/markdown``, byte-identical); ``License-Expression: Apache-2.0`` with the license
  file shipped under ``.dist-info/licenses/`` and identical to the repository's LICENSE; classifiers
  ``Typing :: Typed`` and the tested Python versions only; the project URLs (the repository URL of the
  root pyproject).
* entry_points.txt: every console script and entry point the pyproject declares (and :data:`REQUIRED`).
* files: every file of ``src/<package>/`` (modules, ``py.typed``, example TOML/YAML) with identical bytes.
* RECORD: lists every file of the archive with the right sha256 and size; nothing listed is absent.
* WHEEL: pure Python (``py3-none-any``, ``Root-Is-Purelib: true``).
* sdist: PKG-INFO, pyproject.toml, README.md, LICENSE, CHANGELOG.md and the whole ``src/`` tree.

Exit status: 0 all complete; 1 something is missing (one line per problem, naming the file and the fix);
2 bad usage (no such directory, unknown package).
"""

from __future__ import annotations

import argparse
import base64
import configparser
import csv
import hashlib
import io
import re
import sys
import tarfile
import zipfile
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from email.message import Message
from email.parser import BytesParser
from email.policy import compat32
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from workspace import ROOT, TESTED_PYTHONS, Package, packages, repository

PROJECT_URLS = ("Homepage", "Documentation", "Repository", "Changelog", "Issues")
LICENSE = "Apache-2.0"


@dataclass(frozen=True)
class Required:
    """What a distribution must ship whatever its pyproject says (a dropped line fails the check)."""

    scripts: tuple[str, ...] = ()
    entry_points: tuple[tuple[str, str, str], ...] = ()  # (group, name, value)
    files: tuple[str, ...] = ("py.typed",)  # relative to the import package


REQUIRED: dict[str, Required] = {
    "composer-core": Required(scripts=("composer-replay", "composer-bypass")),
    "composer-trl": Required(scripts=("composer-train",)),
    "composer-verl": Required(
        entry_points=(("verl.plugins", "composer", "composer_verl.plugin"),),
        files=("py.typed", "examples/composer_grpo.yaml"),
    ),
    "composer-prime-rl": Required(files=("py.typed", "examples/rl.toml", "examples/trainer.toml")),
    "composer-monarch": Required(),
    "composer-diloco": Required(),
}


@dataclass
class Expected:
    """Everything the wheel and sdist of one package must contain."""

    package: Package
    repository: str
    license_text: bytes
    readme: bytes
    entry_points: dict[str, dict[str, str]] = field(default_factory=dict)
    files: dict[str, bytes] = field(default_factory=dict)  # wheel path -> bytes


def expected(package: Package, root: Path = ROOT) -> Expected:
    """Collect the expectations for ``package`` from its pyproject, its source tree and :data:`REQUIRED`."""
    required = REQUIRED.get(package.name, Required())
    project = package.project
    groups: dict[str, dict[str, str]] = {}
    scripts = dict(project.get("scripts", {}))
    for name in required.scripts:
        scripts.setdefault(name, "<declared in pyproject.toml [project.scripts]>")
    if scripts:
        groups["console_scripts"] = scripts
    for group, entries in project.get("entry-points", {}).items():
        groups.setdefault(group, {}).update(entries)
    for group, name, value in required.entry_points:
        groups.setdefault(group, {}).setdefault(name, value)
    files = {
        f"{package.import_name}/{p.relative_to(package.source).as_posix()}": p.read_bytes()
        for p in sorted(package.source.rglob("*"))
        if p.is_file() and "__pycache__" not in p.parts and p.suffix != ".pyc"
    }
    for rel in required.files:
        files.setdefault(f"{package.import_name}/{rel}", b"")  # absent from src too: reported as missing
    return Expected(
        package=package,
        repository=repository(root),
        license_text=(root / "LICENSE").read_bytes(),
        readme=(package.directory / project.get("readme", "README.md")).read_bytes(),
        entry_points=groups,
        files=files,
    )


def _metadata(raw: bytes) -> tuple[Message, bytes]:
    head, _, body = raw.partition(b"\n\n")
    return BytesParser(policy=compat32).parsebytes(head + b"\n\n"), body


def _requirement_name(req: str) -> str:
    return re.split(r"[\s<>=!~;\[(@]", req.strip(), maxsplit=1)[0].lower().replace("_", "-")


def _check_metadata(raw: bytes, exp: Expected, where: str) -> list[str]:
    pkg = exp.package
    meta, body = _metadata(raw)
    out: list[str] = []

    def need(key: str, want: str | None = None) -> None:
        got = meta.get(key)
        if got is None:
            out.append(f"{where}: no {key} (set it in pyproject.toml [project])")
        elif want is not None and got != want:
            out.append(f"{where}: {key} is {got!r}, pyproject.toml says {want!r}")

    need("Name", pkg.name)
    need("Version", pkg.version)
    need("Summary", pkg.project.get("description"))
    need("Requires-Python", pkg.project.get("requires-python"))
    need("License-Expression", LICENSE)
    if "LICENSE" not in meta.get_all("License-File", []):
        out.append(f'{where}: no License-File: LICENSE (add license-files = ["LICENSE"] to [project])')
    if meta.get("Description-Content-Type") != "text/markdown":
        out.append(f"{where}: Description-Content-Type is not text/markdown (readme = 'README.md')")
    if body.strip() != exp.readme.strip():
        out.append(f"{where}: long description is not the package README.md (readme = 'README.md')")
    out += _check_classifiers(meta.get_all("Classifier", []), where)
    out += _check_urls(meta.get_all("Project-URL", []), exp, where)
    declared = {_requirement_name(r) for r in pkg.project.get("dependencies", [])}
    shipped = {_requirement_name(r) for r in meta.get_all("Requires-Dist", []) if "extra ==" not in r}
    for name in sorted(declared - shipped):
        out.append(f"{where}: dependency {name!r} of pyproject.toml is missing from Requires-Dist")
    return out


def _check_classifiers(classifiers: list[str], where: str) -> list[str]:
    """``Typing :: Typed`` and one Python classifier per tested version, no other."""
    out = [] if "Typing :: Typed" in classifiers else [f"{where}: no classifier 'Typing :: Typed'"]
    versions = {
        c.rsplit(" :: ", 1)[1]
        for c in classifiers
        if re.fullmatch(r"Programming Language :: Python :: 3\.\d+", c)
    }
    for v in sorted(set(TESTED_PYTHONS) - versions):
        out.append(f"{where}: no classifier 'Programming Language :: Python :: {v}' (a tested version)")
    for v in sorted(versions - set(TESTED_PYTHONS)):
        out.append(
            f"{where}: classifier 'Programming Language :: Python :: {v}' but CI tests only {', '.join(TESTED_PYTHONS)}"
        )
    return out


def _check_urls(project_urls: list[str], exp: Expected, where: str) -> list[str]:
    """Every label of :data:`PROJECT_URLS`, and the Repository URL of the root pyproject."""
    urls = dict(u.split(", ", 1) for u in project_urls if ", " in u)
    out = [
        f"{where}: no Project-URL {label!r} (add it to [project.urls])"
        for label in PROJECT_URLS
        if label not in urls
    ]
    if urls.get("Repository") not in (None, exp.repository):
        out.append(
            f"{where}: Project-URL Repository is {urls['Repository']!r}, the root pyproject says {exp.repository!r}"
        )
    return out


def _check_entry_points(raw: bytes | None, exp: Expected, where: str) -> list[str]:
    if not exp.entry_points:
        return []
    if raw is None:
        groups = ", ".join(sorted(exp.entry_points))
        return [
            f"{where}: no entry_points.txt (expected groups: {groups}; [project.scripts] / [project.entry-points])"
        ]
    parser = configparser.ConfigParser(delimiters=("=",), interpolation=None)
    parser.optionxform = str  # type: ignore[assignment,method-assign]
    parser.read_string(raw.decode())
    out = []
    for group, entries in exp.entry_points.items():
        for name, value in entries.items():
            got = parser.get(group, name, fallback=None)
            what = "console script" if group == "console_scripts" else f"entry point [{group}]"
            if got is None:
                out.append(f"{where}: {what} {name!r} missing (declare {name} = {value!r} in pyproject.toml)")
            elif not value.startswith("<") and got.strip() != value:
                out.append(f"{where}: {what} {name!r} is {got.strip()!r}, expected {value!r}")
    return out


def _b64_sha256(data: bytes) -> str:
    return base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def _check_record(zf: zipfile.ZipFile, record_name: str, where: str) -> list[str]:
    names = [n for n in zf.namelist() if not n.endswith("/")]
    if record_name not in names:
        return [f"{where}: no {record_name}"]
    rows = {row[0]: row for row in csv.reader(io.StringIO(zf.read(record_name).decode())) if row}
    out = []
    for name in names:
        if name == record_name:
            continue
        row = rows.get(name)
        if row is None:
            out.append(f"{where}: {name} is not listed in RECORD")
            continue
        data = zf.read(name)
        if row[1] != f"sha256={_b64_sha256(data)}":
            out.append(f"{where}: RECORD hash of {name} does not match its content")
        if row[2] != str(len(data)):
            out.append(f"{where}: RECORD size of {name} is {row[2]}, the file has {len(data)} bytes")
    for name in sorted(set(rows) - set(names)):
        out.append(f"{where}: RECORD lists {name}, which is not in the archive")
    return out


def check_wheel(path: Path, exp: Expected) -> list[str]:
    """Problems of one wheel (empty list: complete)."""
    where = path.name
    info = f"{exp.package.wheel_stem}.dist-info"
    try:
        zf = zipfile.ZipFile(path)
    except (OSError, zipfile.BadZipFile) as e:
        return [f"{where}: not a readable wheel ({e})"]
    with zf:
        names = set(zf.namelist())
        out: list[str] = []
        if f"{info}/METADATA" not in names:
            return [
                f"{where}: no {info}/METADATA (is this a wheel of {exp.package.name} {exp.package.version}?)"
            ]
        out += _check_metadata(zf.read(f"{info}/METADATA"), exp, where)
        ep = f"{info}/entry_points.txt"
        out += _check_entry_points(zf.read(ep) if ep in names else None, exp, where)
        lic = f"{info}/licenses/LICENSE"
        if lic not in names:
            out.append(f"{where}: no {lic} (license-files = ['LICENSE'] and a LICENSE file in the package)")
        elif zf.read(lic) != exp.license_text:
            out.append(f"{where}: {lic} differs from the repository's LICENSE (copy it again)")
        for rel, data in exp.files.items():
            if rel not in names:
                out.append(
                    f"{where}: {rel} is missing (package data under src/ is shipped by hatch's packages=)"
                )
            elif data and zf.read(rel) != data:
                out.append(f"{where}: {rel} differs from the source tree (rebuild)")
        wheel_file = f"{info}/WHEEL"
        if wheel_file not in names:
            out.append(f"{where}: no {wheel_file}")
        else:
            wheel = BytesParser(policy=compat32).parsebytes(zf.read(wheel_file))
            if wheel.get(
                "Root-Is-Purelib", ""
            ).strip().lower() != "true" or "py3-none-any" not in wheel.get_all("Tag", []):
                out.append(f"{where}: not a pure-Python py3-none-any wheel")
        out += _check_record(zf, f"{info}/RECORD", where)
    return out


def check_sdist(path: Path, exp: Expected) -> list[str]:
    """Problems of one sdist (empty list: complete)."""
    where = path.name
    top = f"{exp.package.wheel_stem}"
    try:
        with tarfile.open(path) as tf:
            members = {m.name: m for m in tf.getmembers() if m.isfile()}
            out = []
            pkg_info = members.get(f"{top}/PKG-INFO")
            if pkg_info is None:
                return [f"{where}: no {top}/PKG-INFO"]
            raw = tf.extractfile(pkg_info).read()  # type: ignore[union-attr]
            out += _check_metadata(raw, exp, where)
            for rel in ("pyproject.toml", "README.md", "LICENSE", "CHANGELOG.md"):
                if f"{top}/{rel}" not in members:
                    out.append(f"{where}: {rel} is missing from the sdist")
            for rel in exp.files:
                if f"{top}/src/{rel}" not in members:
                    out.append(f"{where}: src/{rel} is missing from the sdist")
    except (OSError, tarfile.TarError) as e:
        return [f"{where}: not a readable sdist ({e})"]
    return out


def _find(dist: Path, pattern: str) -> list[Path]:
    return sorted(dist.glob(pattern))


def check_dist(dist: Path, names: Iterable[str] | None = None, root: Path = ROOT) -> list[str]:
    """Check the wheel and sdist of every named package (default: all) found in ``dist``."""
    workspace = packages(root)
    out: list[str] = []
    for name in names or workspace:
        pkg = workspace[name]
        exp = expected(pkg, root)
        for kind, pattern, check in (
            ("wheel", f"{pkg.wheel_stem}-*.whl", check_wheel),
            ("sdist", f"{pkg.wheel_stem}.tar.gz", check_sdist),
        ):
            found = _find(dist, pattern)
            if len(found) != 1:
                out.append(
                    f"{dist}: expected one {kind} {pattern}, found {len(found)} "
                    f"(uv build --package {pkg.name} --out-dir {dist})"
                )
                continue
            out += check(found[0], exp)
    return out


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("dist", type=Path, help="directory holding the built wheels and sdists")
    parser.add_argument("--package", action="append", help="distribution name (repeatable; default: all six)")
    parser.add_argument("--root", type=Path, default=ROOT, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if not args.dist.is_dir():
        print(
            f"check_wheels: {args.dist} is not a directory; build first (uv build --all-packages --out-dir DIR)"
        )
        return 2
    known = packages(args.root)
    unknown = [n for n in args.package or [] if n not in known]
    if unknown:
        print(f"check_wheels: unknown package {', '.join(unknown)}; choose from {', '.join(known)}")
        return 2
    problems = check_dist(args.dist, args.package, args.root)
    for line in problems:
        print(line)
    checked = args.package or list(known)
    if problems:
        print(f"check_wheels: {len(problems)} problem(s) in the distributions of {', '.join(checked)}")
        return 1
    print(f"check_wheels: {len(checked)} wheel(s) and sdist(s) complete: {', '.join(checked)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
