"""Each composer option is declared once, in core (``composer_core.loss.options`` / ``config``): its default and
its help text. Adapters derive theirs (``ComposeConfig.alpha_sdpo``, ``flat_defaults()``, ``option_help()``).

This scan reads every adapter's source (``packages/composer-{trl,verl,prime-rl,monarch,diloco}/src``) by AST and
fails, naming each place, where

- a string literal repeats a core option's help text (``option_help``);
- a default of a core option (a flat name of ``flat_option_names()``) is a literal: a parameter default, a class
  field (plain or ``field(default=...)``/a field helper's first argument), an assignment to the name (variable,
  attribute or ``["name"]`` item), a fallback (``.get/.setdefault/.pop("name", lit)``, ``getattr(x, "name",
  lit)``), an ``add_argument("--name", default=lit)``;
- a keyword ``name=lit`` or a mapping entry ``"name": lit`` repeats core's default value (presets that differ
  from core's default, e.g. a recipe's ``{"dpo_variant": "simpo"}``, are choices, not copies).
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest
from composer_core.loss.config import flat_defaults, flat_option_names, option_help

PACKAGES = Path(__file__).resolve().parents[3]
ADAPTERS = ("composer-trl", "composer-verl", "composer-prime-rl", "composer-monarch", "composer-diloco")
NAMES = frozenset(flat_option_names())
DEFAULTS = flat_defaults()
HELP = {option_help(n): n for n in NAMES}
#: (package, owner, name) -> why a host keeps a default of its own for a core option
HOST_DEFAULTS = {
    (
        "composer-trl",
        "ComposerGRPOConfig",
        "sdpo_form",
    ): "TRL computes one form's inputs itself, so it needs a "
    "concrete form; core's 'auto' resolves from a batch's inputs",
}
_FALLBACKS = ("get", "setdefault", "pop")


def _literal(node: ast.expr | None) -> bool:
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        node = node.operand
    if isinstance(node, ast.Tuple):
        return all(_literal(e) for e in node.elts)
    return isinstance(node, ast.Constant)


def _value(node: ast.expr) -> object:
    return ast.literal_eval(node)


def _field_default(name: str, value: ast.expr | None) -> ast.expr | None:
    """A class field's default: the value, ``field(default=...)``'s, or a field helper's first argument (unless
    it is the option's own name, a key that looks the default up)."""
    if not isinstance(value, ast.Call):
        return value
    kw = next((k.value for k in value.keywords if k.arg == "default"), None)
    if kw is not None or not value.args:
        return kw
    first = value.args[0]
    return None if isinstance(first, ast.Constant) and first.value == name else first


def _key(node: ast.expr) -> str | None:
    """The option a string constant names (``"alpha_sdpo"``, ``"--alpha_sdpo"``, ``"--alpha-sdpo"``)."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        name = node.value.lstrip("-").replace("-", "_")
        return name if name in NAMES else None
    return None


def _target(node: ast.expr) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    if isinstance(node, ast.Subscript):
        return _key(node.slice)
    return None


class _Scan(ast.NodeVisitor):
    def __init__(self) -> None:
        self.owner: list[str] = []
        self.found: list[tuple[int, str, str, str]] = []  # (line, owner, name, what)
        self.fields: set[int] = set()  # ids of class-body statements (judged as fields)

    def _flag(self, node: ast.AST, name: str, what: str) -> None:
        self.found.append((getattr(node, "lineno", 0), ".".join(self.owner), name, what))

    def _scoped(self, node: ast.AST, name: str) -> None:
        self.owner.append(name)
        self.generic_visit(node)
        self.owner.pop()

    def visit_ClassDef(self, node: ast.ClassDef) -> None:
        self.fields.update(id(stmt) for stmt in node.body)
        for stmt in node.body:
            targets = [stmt.target] if isinstance(stmt, ast.AnnAssign) else getattr(stmt, "targets", [])
            for t in targets:
                name = _target(t)
                default = _field_default(name or "", getattr(stmt, "value", None))
                if name in NAMES and _literal(default):
                    self.owner.append(node.name)
                    self._flag(stmt, name, f"field default {ast.unparse(default)}")  # type: ignore[arg-type]
                    self.owner.pop()
        self._scoped(node, node.name)

    def visit_FunctionDef(self, node: ast.FunctionDef | ast.AsyncFunctionDef) -> None:
        a = node.args
        positional = a.posonlyargs + a.args
        pairs = [
            *zip(positional[len(positional) - len(a.defaults) :], a.defaults),
            *zip(a.kwonlyargs, a.kw_defaults),
        ]
        self.owner.append(node.name)
        for arg, default in pairs:
            if arg.arg in NAMES and _literal(default):
                self._flag(node, arg.arg, f"parameter default {ast.unparse(default)}")  # type: ignore[arg-type]
        self.owner.pop()
        self._scoped(node, node.name)

    visit_AsyncFunctionDef = visit_FunctionDef  # type: ignore[assignment]

    def _assign(self, node: ast.Assign | ast.AnnAssign, targets: list[ast.expr]) -> None:
        if id(node) in self.fields:
            return  # class fields: visit_ClassDef
        for t in targets:
            name = _target(t)
            if name in NAMES and _literal(node.value):
                self._flag(node, name, f"assignment {ast.unparse(t)} = {ast.unparse(node.value)}")  # type: ignore[arg-type]

    def visit_Assign(self, node: ast.Assign) -> None:
        self._assign(node, node.targets)
        self.generic_visit(node)

    def visit_AnnAssign(self, node: ast.AnnAssign) -> None:
        self._assign(node, [node.target])
        self.generic_visit(node)

    def visit_Call(self, node: ast.Call) -> None:
        func = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
        args = node.args
        if func in _FALLBACKS and len(args) == 2 and _key(args[0]) and _literal(args[1]):
            self._flag(node, _key(args[0]), f"fallback {ast.unparse(node)}")  # type: ignore[arg-type]
        if func == "getattr" and len(args) == 3 and _key(args[1]) and _literal(args[2]):
            self._flag(node, _key(args[1]), f"fallback {ast.unparse(node)}")  # type: ignore[arg-type]
        for k in node.keywords:
            if func == "add_argument" and k.arg == "default" and args and _key(args[0]) and _literal(k.value):
                self._flag(node, _key(args[0]), f"argument default {ast.unparse(k.value)}")  # type: ignore[arg-type]
            elif k.arg in NAMES and _literal(k.value) and _value(k.value) == DEFAULTS.get(k.arg, ...):
                self._flag(node, k.arg, f"keyword repeats core's default: {k.arg}={ast.unparse(k.value)}")
        self.generic_visit(node)

    def visit_Dict(self, node: ast.Dict) -> None:
        for k, v in zip(node.keys, node.values):
            name = _key(k) if k is not None else None
            if name and _literal(v) and _value(v) == DEFAULTS.get(name, ...):
                self._flag(node, name, f"entry repeats core's default: {ast.unparse(k)}: {ast.unparse(v)}")  # type: ignore[arg-type]
        self.generic_visit(node)

    def visit_Constant(self, node: ast.Constant) -> None:
        if isinstance(node.value, str):
            for text, name in HELP.items():
                if node.value == text or (len(text) >= 40 and text in node.value):
                    self._flag(node, name, "repeats core's help text")


def scan(source: str) -> list[tuple[int, str, str, str]]:
    s = _Scan()
    s.visit(ast.parse(source))
    return s.found


def _adapter_findings() -> Iterator[tuple[str, str, str, str]]:
    for package in ADAPTERS:
        for path in sorted((PACKAGES / package / "src").rglob("*.py")):
            for line, owner, name, what in scan(path.read_text()):
                yield package, f"{path.relative_to(PACKAGES)}:{line}", f"{owner}:{name}", what


def test_no_adapter_repeats_a_core_default_or_help_text() -> None:
    if not (PACKAGES / "composer-trl" / "src").is_dir():
        pytest.skip("not a source checkout (the adapters' src is not beside composer-core)")
    found, excused = [], set()
    for package, where, owner_name, what in _adapter_findings():
        owner, name = owner_name.rsplit(":", 1)
        key = (package, owner.split(".")[0], name)
        if key in HOST_DEFAULTS and "default" in what and "repeats" not in what:
            excused.add(key)
            continue
        found.append(f"{where} {owner_name}: {what}")
    assert not found, (
        "core options re-declared in an adapter (derive the default from core: ComposeConfig.<name> / "
        "flat_defaults()[name], and the help text from composer_core.loss.config.option_help(name)):\n"
        + "\n".join(found)
    )
    assert excused == set(HOST_DEFAULTS), sorted(set(HOST_DEFAULTS) - excused)  # a stale excuse is deleted


def test_the_scan_flags_each_form_of_a_second_declaration() -> None:
    """The scan can fail: each way of writing a core option's default or help a second time is flagged; the
    derived forms are not."""
    help_text = option_help("sdpo_token_clip")
    src = f"""
from dataclasses import dataclass, field
def f(x, alpha_sdpo=1.0, *, sdpo_beta=0.5, kl_beta=PolicyOptions.kl_beta): ...
@dataclass
class C:
    beta_replay: float = 0.0
    dpo_beta: float = field(default=0.1)
    simpo_gamma: float = _helped(0.5, "margin")
    sdpo_wrapper: str = _core("sdpo_wrapper")
    w_policy: float = ComposeConfig.w_policy
    other: str = {help_text!r}
kwargs.setdefault("alpha_sdpo", 1.0)
beta = getattr(config, "beta_replay", 0.0)
chosen["alpha_sdpo"] = 1.0
parser.add_argument("--sdpo-topk", default=4)
ComposeConfig(dpo_variant="dpo", alpha_sdpo=0.5)
PRESET = {{"dpo_variant": "dpo", "alpha_sdpo": 1.0}}
"""
    found = {(owner, name, what.split()[0]) for _, owner, name, what in scan(src)}
    assert found == {
        ("f", "alpha_sdpo", "parameter"),
        ("f", "sdpo_beta", "parameter"),
        ("C", "beta_replay", "field"),
        ("C", "dpo_beta", "field"),
        ("C", "simpo_gamma", "field"),
        ("C", "sdpo_token_clip", "repeats"),
        ("", "alpha_sdpo", "fallback"),
        ("", "beta_replay", "fallback"),
        ("", "alpha_sdpo", "assignment"),
        ("", "sdpo_topk", "argument"),
        ("", "dpo_variant", "keyword"),
        ("", "dpo_variant", "entry"),
    }
