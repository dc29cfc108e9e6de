"""``load_env(spec)``: an environment from one string (``--env`` of composer-train, a recipe's ``env = ...``).

The specs and their errors: the README's ``load_env`` row. An entry point ``name = "pkg.module:factory"`` in
the group ``composer_core.envs`` adds the scheme ``name``: ``factory(target, **kw)`` returns an
:class:`~composer_core.envs.Environment`. Keyword arguments of :func:`load_env` go to the environment's
constructor.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from importlib.metadata import EntryPoint, entry_points
from typing import Any, cast

from .base import Environment
from .digit_reversal import DigitReversalEnv

__all__ = ["BUILTIN_SCHEMES", "ENTRY_POINT_GROUP", "known_schemes", "load_env"]

ENTRY_POINT_GROUP = "composer_core.envs"
BUILTIN_SCHEMES: dict[str, tuple[str, str]] = {
    # scheme (also the extra that installs the host library): (module, class)
    "openenv": ("composer_core.envs.openenv", "OpenEnvEnvironment"),
    "verifiers": ("composer_core.envs.verifiers", "VerifiersEnvironment"),
}
_EXAMPLES = "digit-reversal, openenv:http://127.0.0.1:8000, verifiers:my_env_module"


def _entry_point_factories() -> dict[str, EntryPoint]:
    return {ep.name: ep for ep in entry_points(group=ENTRY_POINT_GROUP)}


def known_schemes() -> list[str]:
    """Every scheme :func:`load_env` accepts (``digit-reversal`` takes no target)."""
    return sorted({"digit-reversal", *BUILTIN_SCHEMES, *_entry_point_factories()})


def _bad(spec: object, why: str) -> ValueError:
    return ValueError(
        f"--env {spec!r}: {why}; known: {', '.join(known_schemes())} (use one of e.g. {_EXAMPLES})"
    )


def _builtin(scheme: str, target: str, kw: dict[str, Any]) -> Environment:
    module_name, attr = BUILTIN_SCHEMES[scheme]
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        hint = f"pip install 'composer-core[{scheme}]'"
        raise ImportError(f"--env {scheme}:{target} needs the {scheme} adapter ({e}); {hint}") from e
    return cast(Environment, getattr(module, attr)(target, **kw))


def load_env(spec: str, **kw: Any) -> Environment:
    """The environment ``spec`` names (see the module docstring)."""
    if not isinstance(spec, str) or not spec.strip():
        raise _bad(spec, "expected a non-empty string '<scheme>:<target>' or 'digit-reversal'")
    spec = spec.strip()
    if spec == "digit-reversal":
        return DigitReversalEnv(**kw)
    scheme, sep, target = spec.partition(":")
    if not sep:
        raise _bad(spec, "no scheme (expected '<scheme>:<target>')")
    if not target:
        raise _bad(spec, f"scheme {scheme!r} needs a target after ':'")
    if scheme in BUILTIN_SCHEMES:
        return _builtin(scheme, target, kw)
    plugins = _entry_point_factories()
    if scheme in plugins:
        factory = cast(Callable[..., Environment], plugins[scheme].load())
        return factory(target, **kw)
    raise _bad(spec, f"unknown scheme {scheme!r}")
