"""The install commands of the READMEs: parsed, checked against the workspace, and turned into the
commands ``nox -s installed`` runs.

Each package README has three fenced blocks, tagged after the language (GitHub shows them as bash):

* ```` ```bash install-test ````: from a clone, ``pip install ./packages/composer-core ./packages/composer-<pkg>``.
  ``nox -s installed`` runs exactly these commands, with each ``./packages/<dir>`` replaced by the wheel
  built from that directory and ``pip install`` by ``uv pip install`` into the fresh venv (same
  arguments): a README command that stops working fails CI.
* ```` ```bash install-git ````: the same requirements from the git URL,
  ``"composer-<pkg> @ git+<repository>#subdirectory=packages/composer-<pkg>"``. The check verifies the URL
  is the root pyproject's repository, the subdirectory exists and holds that distribution, and the
  requirements equal the clone form's; ``nox -s installed`` also runs these commands with the repository
  URL replaced by the local clone (``git+file://``, ``--no-deps``: builds each subdirectory from git).
* ```` ```bash install-index ````: ``pip install composer-<pkg>`` for after publishing.

An install-test block may carry a name (```` ```bash install-test verifiers ````): an extra that cannot share
the main block's environment (e.g. ``[verifiers]``, whose pins conflict with ``[openenv]``). ``nox -s
installed`` installs each named block into its own fresh venv and runs ``scripts/smoke/<pkg>_<name>.py``
there; the install-git block must hold the union of all install-test blocks' requirements.

Any other fenced block of a README that installs a workspace distribution from the index is reported
(it would fail today: nothing is published). ``python scripts/readme_install.py`` checks every README.
"""

from __future__ import annotations

import re
import shlex
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from workspace import ROOT, Package, packages, repository

FENCE = re.compile(
    r"^(?P<indent> *)```(?P<info>[^\n`]*)\n(?P<body>.*?)^(?P=indent)```", re.MULTILINE | re.DOTALL
)
KINDS = ("install-test", "install-git", "install-index")
NAME = re.compile(r"(?P<name>[A-Za-z0-9][A-Za-z0-9._-]*)(?:\[(?P<extras>[^\]]*)\])?")
CLONE = re.compile(r"\./packages/(?P<dir>[A-Za-z0-9._-]+?)/?(?:\[(?P<extras>[^\]]*)\])?")
GIT = re.compile(
    r"(?P<name>[A-Za-z0-9][A-Za-z0-9._-]*)(?:\[(?P<extras>[^\]]*)\])?\s*@\s*git\+(?P<url>[^#@\s]+?)(?:\.git)?"
    r"(?:@(?P<ref>[^#\s]+))?#subdirectory=(?P<subdir>\S+)"
)

Req = tuple[str, frozenset[str]]  # (distribution, extras)


@dataclass(frozen=True)
class Block:
    kind: str  # install-test / install-git / install-index / "" for any other block
    body: str
    line: int
    name: str = ""  # a named install-test block (its own venv in nox -s installed)


def blocks(text: str) -> list[Block]:
    out = []
    for m in FENCE.finditer(text):
        words = m["info"].split()
        kind = next((w for w in words if w in KINDS), "")
        rest = words[words.index(kind) + 1 :] if kind else []
        out.append(Block(kind, m["body"], text.count("\n", 0, m.start()) + 1, rest[0] if rest else ""))
    return out


def commands(body: str) -> list[list[str]]:
    """Shell commands of a block (continuations joined, comments dropped), each split into words."""
    joined = re.sub(r"\\\n", " ", body)
    return [words for line in joined.splitlines() if (words := shlex.split(line, comments=True))]


def pip_install_args(words: list[str]) -> list[str] | None:
    """The arguments after ``pip install`` / ``uv pip install`` / ``python -m pip install`` (None: not one)."""
    for prefix in (
        ["pip", "install"],
        ["uv", "pip", "install"],
        ["python", "-m", "pip", "install"],
        ["uv", "add"],
    ):
        if words[: len(prefix)] == prefix:
            return words[len(prefix) :]
    return None


def _extras(raw: str | None) -> frozenset[str]:
    return frozenset(e.strip() for e in (raw or "").split(",") if e.strip())


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def check_readme(pkg: Package, root: Path = ROOT) -> list[str]:
    """Problems of one package README's install blocks (empty: consistent)."""
    where = f"packages/{pkg.directory.name}/README.md"
    text = (pkg.directory / "README.md").read_text()
    workspace = {_norm(p.name): p for p in packages(root).values()}
    found = {k: [b for b in blocks(text) if b.kind == k] for k in KINDS}
    out = [f"{where}: no ```bash {k} block (see scripts/readme_install.py)" for k in KINDS if not found[k]]
    out += index_form_outside_blocks(text, where, workspace)
    out += untested_clone_commands(text, where, root)
    if out:
        return out
    forms: dict[str, set[Req]] = {}
    venvs: dict[str, set[Req]] = {}  # install-test block name ("": the main one) -> what its venv gets
    for kind in KINDS:
        forms[kind] = set()
        for block in found[kind]:
            own_reqs = _block_reqs(block, kind, where, (repository(root), root, workspace), out)
            forms[kind] |= own_reqs
            if kind == "install-test":
                venvs.setdefault(block.name, set()).update(own_reqs)
    return out + _consistency(pkg, where, forms, venvs)


def _block_reqs(
    block: Block, kind: str, where: str, ctx: tuple[str, Path, dict[str, Package]], out: list[str]
) -> set[Req]:
    """The requirements one block installs (``ctx``: repository URL, root, workspace packages); its problems are
    appended to ``out``."""
    reqs: set[Req] = set()
    for words in commands(block.body):
        args = pip_install_args(words)
        if args is None:
            out.append(f"{where}:{block.line}: {kind} block holds {shlex.join(words)!r}, not a pip install")
            continue
        for arg in (a for a in args if not a.startswith("-")):
            req, problem = _parse(kind, arg, *ctx)
            if problem:
                out.append(f"{where}:{block.line}: {problem}")
            elif req:
                reqs.add(req)
    return reqs


def _consistency(
    pkg: Package, where: str, forms: dict[str, set[Req]], venvs: dict[str, set[Req]]
) -> list[str]:
    """The blocks agree: the main install-test block installs the package and composer-core, every named block
    (its own venv) too, and the git / index forms install what the clone form does."""
    out: list[str] = []
    main_block = venvs.get("", set())  # named blocks are checked below, each its own venv
    own = {r for r in main_block if r[0] == pkg.name}
    if not own:
        out.append(
            f"{where}: the install-test block does not install {pkg.name} (./packages/{pkg.directory.name})"
        )
    if "composer-core" not in {r[0] for r in main_block}:
        out.append(
            f"{where}: the install-test block must install ./packages/composer-core too (not on PyPI yet)"
        )
    for name, reqs in sorted((n, r) for n, r in venvs.items() if n):
        missing = {pkg.name, "composer-core"} - {r[0] for r in reqs}
        if missing:
            out.append(
                f"{where}: the install-test block {name!r} (its own venv) does not install "
                f"{', '.join(sorted(missing))}"
            )
    if forms["install-git"] != forms["install-test"]:
        out.append(
            f"{where}: the install-git block installs {_show(forms['install-git'])}, "
            f"the install-test block {_show(forms['install-test'])}; make them the same"
        )
    if not own <= forms["install-index"]:  # named blocks: their index form is optional
        out.append(f"{where}: the install-index block does not install {_show(own)}")
    return out


def _show(reqs: set[Req]) -> str:
    return ", ".join(sorted(n + (f"[{','.join(sorted(e))}]" if e else "") for n, e in reqs)) or "nothing"


def _parse(
    kind: str, arg: str, repo: str, root: Path, workspace: dict[str, Package]
) -> tuple[Req | None, str]:
    if kind == "install-test":
        m = CLONE.fullmatch(arg)
        if not m:
            return None, f"install-test: {arg!r} is not ./packages/<dir>[extras] (the clone form)"
        directory = root / "packages" / m["dir"]
        if not (directory / "pyproject.toml").is_file():
            return None, f"install-test: {arg!r}: packages/{m['dir']} has no pyproject.toml"
        pkg = next(p for p in workspace.values() if p.directory.name == m["dir"])
        return _with_extras(kind, arg, pkg, _extras(m["extras"]))
    if kind == "install-git":
        m = GIT.fullmatch(arg)
        if not m:
            return (
                None,
                f"install-git: {arg!r} is not 'name[extras] @ git+{repo}#subdirectory=packages/<dir>'",
            )
        if m["url"].rstrip("/") != repo:
            return None, f"install-git: {arg!r} uses {m['url']}, the repository is {repo} (root pyproject)"
        sub = root / m["subdir"]
        if not (sub / "pyproject.toml").is_file():
            return None, f"install-git: {arg!r}: subdirectory {m['subdir']} has no pyproject.toml"
        name = next((p.name for p in workspace.values() if p.directory == sub.resolve()), None)
        if name is None or _norm(name) != _norm(m["name"]):
            return None, f"install-git: {arg!r}: {m['subdir']} holds {name}, not {m['name']}"
        return _with_extras(kind, arg, workspace[_norm(name)], _extras(m["extras"]))
    m = NAME.match(arg)
    if not m:
        return None, f"install-index: cannot read {arg!r}"
    return (_norm(m["name"]), _extras(m["extras"])), ""


def _with_extras(kind: str, arg: str, pkg: Package, extras: frozenset[str]) -> tuple[Req | None, str]:
    """A requirement of ``pkg`` whose extras must exist (pip and uv only warn about an unknown extra)."""
    unknown = sorted(extras - set(pkg.project.get("optional-dependencies", {})))
    if unknown:
        return None, f"{kind}: {arg!r}: {pkg.name} has no extra {', '.join(unknown)}"
    return (pkg.name, extras), ""


def index_form_outside_blocks(text: str, where: str, workspace: dict[str, Package]) -> list[str]:
    """Fenced blocks that install a workspace distribution from the index without being install-index."""
    out = []
    for block in blocks(text):
        if block.kind == "install-index":
            continue
        for words in commands(block.body) if block.kind else _shell_like(block.body):
            args = pip_install_args(words) or []
            for arg in args:
                m = NAME.fullmatch(arg) or re.fullmatch(
                    r"(?P<name>[A-Za-z0-9][A-Za-z0-9._-]*)(\[[^\]]*\])?[<>=!~].*", arg
                )
                if m and _norm(m["name"]) in workspace:
                    out.append(
                        f"{where}:{block.line}: {shlex.join(words)!r} installs {m['name']} from the index, "
                        "where it is not published yet: use the clone form, or tag the block install-index"
                    )
    return out


def _clone_reqs(words: list[str], root: Path, workspace: dict[str, Package]) -> frozenset[Req] | None:
    args = pip_install_args(words)
    if args is None or not any(a.startswith("./packages/") for a in args):
        return None
    reqs = set()
    for arg in (a for a in args if not a.startswith("-")):
        req, problem = _parse("install-test", arg, "", root, workspace)
        if req is None:
            return frozenset({(f"<unreadable: {problem}>", frozenset())})
        reqs.add(req)
    return frozenset(reqs)


def executed_clone_commands(root: Path = ROOT) -> set[frozenset[Req]]:
    """The requirement sets of every package README's install-test commands (what CI runs)."""
    workspace = {_norm(p.name): p for p in packages(root).values()}
    out = set()
    for pkg in packages(root).values():
        for block in blocks((pkg.directory / "README.md").read_text()):
            if block.kind == "install-test":
                out |= {r for words in commands(block.body) if (r := _clone_reqs(words, root, workspace))}
    return out


def untested_clone_commands(text: str, where: str, root: Path = ROOT) -> list[str]:
    """Clone-form ``pip install ./packages/...`` commands of a README (code spans and blocks) that are not
    one of the install-test commands CI runs."""
    workspace = {_norm(p.name): p for p in packages(root).values()}
    executed = executed_clone_commands(root)
    spans = [m[1] for m in re.finditer(r"(?<!`)`([^`\n]*pip install[^`\n]*)`(?!`)", text)]
    spans += [b.body for b in blocks(text) if b.kind != "install-test"]
    out = []
    for span in spans:
        for words in _shell_like(span):
            reqs = _clone_reqs(words, root, workspace)
            if reqs is not None and reqs not in executed:
                out.append(
                    f"{where}: {shlex.join(words)!r} is not one of the install-test commands CI runs; "
                    "use one of those (or add it to a package README's install-test block)"
                )
    return out


def _shell_like(body: str) -> list[list[str]]:
    try:
        return commands(body)
    except ValueError:  # not shell (Python, TOML with unbalanced quotes, ...)
        return []


def install_test_names(pkg: Package) -> list[str]:
    """The names of ``pkg``'s named install-test blocks (each its own venv in ``nox -s installed``)."""
    found = [b.name for b in blocks((pkg.directory / "README.md").read_text()) if b.kind == "install-test"]
    return sorted({n for n in found if n})


def install_test_commands(
    pkg: Package, wheels: dict[str, Path], root: Path = ROOT, name: str = ""
) -> list[list[str]]:
    """The install-test commands of ``pkg``'s README (the unnamed block(s), or the block named ``name``)
    as ``uv pip install`` arguments, every ``./packages/<dir>[extras]`` replaced by
    ``name[extras] @ file://<wheel built from <dir>>``."""
    workspace = packages(root)
    by_dir = {p.directory.name: p for p in workspace.values()}
    text = (pkg.directory / "README.md").read_text()
    out = []
    for block in (b for b in blocks(text) if b.kind == "install-test" and b.name == name):
        for words in commands(block.body):
            args = pip_install_args(words)
            if args is None:
                raise ValueError(
                    f"{pkg.name} README: install-test command {shlex.join(words)!r} is not a pip install"
                )
            translated = []
            for arg in args:
                m = CLONE.fullmatch(arg)
                if m:
                    if m["dir"] not in by_dir:
                        raise ValueError(
                            f"{pkg.name} README: {arg!r}: no package directory packages/{m['dir']}"
                        )
                    dist = by_dir[m["dir"]].name
                    extras = f"[{m['extras']}]" if m["extras"] else ""
                    translated.append(f"{dist}{extras} @ {wheels[dist].resolve().as_uri()}")
                else:
                    translated.append(arg)
            out.append(translated)
    return out


def install_git_commands(pkg: Package, local_repo: str, root: Path = ROOT) -> list[list[str]]:
    """The install-git commands of ``pkg``'s README as ``uv pip install`` arguments with the repository
    URL replaced by ``local_repo`` (e.g. ``file:///path/to/clone``): the same requirement strings, so
    their syntax, subdirectories and extras are exercised offline against the clone's committed HEAD."""
    repo = repository(root)
    text = (pkg.directory / "README.md").read_text()
    out = []
    for block in (b for b in blocks(text) if b.kind == "install-git"):
        for words in commands(block.body):
            args = pip_install_args(words) or []
            out.append([a.replace(f"git+{repo}", f"git+{local_repo}") for a in args])
    return out


def main(argv: Sequence[str] | None = None) -> int:
    root = Path(argv[0]) if argv else ROOT
    problems = [p for pkg in packages(root).values() for p in check_readme(pkg, root)]
    workspace = {_norm(p.name): p for p in packages(root).values()}
    problems += index_form_outside_blocks((root / "README.md").read_text(), "README.md", workspace)
    problems += untested_clone_commands((root / "README.md").read_text(), "README.md", root)
    for line in problems:
        print(line)
    print(
        f"readme_install: {len(problems)} problem(s)"
        if problems
        else "readme_install: every README's install commands are consistent"
    )
    return 1 if problems else 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
