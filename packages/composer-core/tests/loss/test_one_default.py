"""Every option default is written once: in its option class in ``composer_core/loss/options.py`` (or
``ComposeConfig`` in ``loss/config.py``).

The loss primitives take the option objects (``policy_loss(..., options=PolicyOptions(...))``), and a kernel
parameter that mirrors an option either has no default or reads it from the option class
(``beta: float = SDPOOptions.beta``). This scan of composer_core's source fails when a function parameter, or a
class-level field, named like a field of an option class carries a literal default anywhere else: the second
copy of a default that drifts from the first.
"""

from __future__ import annotations

import ast
import dataclasses
from collections.abc import Iterator
from pathlib import Path

import composer_core
from composer_core.loss.config import DPO, TAID, EntropyOPD, PolicyOptions, SDPOOptions, SimPO

ROOT = Path(composer_core.__file__).parent
HOMES = (Path("loss/config.py"), Path("loss/options.py"))
OPTION_NAMES = frozenset(
    f.name
    for klass in (PolicyOptions, SDPOOptions, DPO, SimPO, TAID, EntropyOPD)
    for f in dataclasses.fields(klass)
)

#: (file, qualified owner, name) that share a name with an option but are another quantity.
OTHER_QUANTITIES = {
    (
        "loss/wrappers.py",
        "TAIDScheduler.__init__",
        "beta",
    ): "the momentum β of TAID's Alg. 1, not a divergence β",
    ("traces/replay.py", "TeacherConfig", "temperature"): "a teacher API's sampling temperature",
}


def _literal(node: ast.expr | None) -> bool:
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        node = node.operand
    if isinstance(node, ast.Tuple):
        return all(_literal(e) for e in node.elts)
    return isinstance(node, ast.Constant)


def _field_default(value: ast.expr | None) -> ast.expr | None:
    """The default of a class-level field: the value, or ``field(default=...)``'s."""
    if isinstance(value, ast.Call) and getattr(value.func, "id", getattr(value.func, "attr", "")) == "field":
        return next((k.value for k in value.keywords if k.arg == "default"), None)
    return value


def _defaults(tree: ast.Module) -> Iterator[tuple[str, str, ast.expr | None, int]]:
    """(owner, name, default, line) of every parameter and class-level field with a default."""

    def visit(node: ast.AST, owner: str) -> Iterator[tuple[str, str, ast.expr | None, int]]:
        for child in ast.iter_child_nodes(node):
            name = (
                f"{owner}.{child.name}" if owner and hasattr(child, "name") else getattr(child, "name", owner)
            )
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                a = child.args
                positional = a.posonlyargs + a.args
                pairs = [
                    *zip(positional[len(positional) - len(a.defaults) :], a.defaults),
                    *zip(a.kwonlyargs, a.kw_defaults),
                ]
                owner_name = name if not isinstance(child, ast.Lambda) else f"{owner}.<lambda>"
                for arg, default in pairs:
                    if default is not None:
                        yield owner_name, arg.arg, default, child.lineno
            if isinstance(child, ast.ClassDef):
                for stmt in child.body:
                    if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
                        yield name, stmt.target.id, _field_default(stmt.value), stmt.lineno
                    elif isinstance(stmt, ast.Assign):
                        for target in stmt.targets:
                            if isinstance(target, ast.Name):
                                yield name, target.id, _field_default(stmt.value), stmt.lineno
            yield from visit(
                child,
                name if isinstance(child, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) else owner,
            )

    yield from visit(tree, "")


def _repeated_defaults() -> tuple[list[str], set[tuple[str, str, str]]]:
    found: list[str] = []
    excused: set[tuple[str, str, str]] = set()
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT)
        if rel in HOMES:
            continue
        for owner, name, default, line in _defaults(ast.parse(path.read_text(), str(path))):
            if name not in OPTION_NAMES or not _literal(default):
                continue
            key = (rel.as_posix(), owner, name)
            if key in OTHER_QUANTITIES:
                excused.add(key)
                continue
            assert default is not None
            found.append(f"{rel}:{line} {owner}({name}={ast.unparse(default)})")
    return found, excused


def test_each_option_default_is_written_once_in_config() -> None:
    found, excused = _repeated_defaults()
    assert not found, (
        "option defaults repeated outside loss/options.py and loss/config.py (take the option object, make the parameter required, "
        "or read the default from the option class, e.g. `beta: float = SDPOOptions.beta`):\n"
        + "\n".join(found)
    )
    # the excuses name real code: a stale entry (renamed or removed) is deleted, never kept
    assert excused == set(OTHER_QUANTITIES), sorted(set(OTHER_QUANTITIES) - excused)


def test_the_scan_sees_parameters_and_fields() -> None:
    """The scan itself: a parameter, a keyword-only parameter and a dataclass field with a literal default are
    found; a default read from the option class is not."""
    src = (
        "from dataclasses import dataclass, field\n"
        "def f(x, beta=0.5, *, epsilon_low=-0.2, temperature=SDPOOptions.temperature): ...\n"
        "@dataclass\nclass C:\n    gamma: float = field(default=0.5)\n    kl_beta: float = PolicyOptions.kl_beta\n"
    )
    flagged = {
        (owner, name)
        for owner, name, default, _ in _defaults(ast.parse(src))
        if name in OPTION_NAMES and _literal(default)
    }
    assert flagged == {("f", "beta"), ("f", "epsilon_low"), ("C", "gamma")}
