"""The PRIME-RL producers against PRIME-RL's own orchestrator source (opt-in: ``PRIME_RL_SRC``).

prime-rl is not on the package index. With ``PRIME_RL_SRC`` pointing at a checkout this module
* runs upstream's ``assign_reference_logprobs`` (``src/prime_rl/orchestrator/algo/routing.py``, its
  imports stubbed where missing) against the stand-in composer_prime_rl uses without PRIME-RL, on the same
  graphs: equal reference log-probs node by node;
* reads upstream's ``Algorithm`` / ``GRPOAlgorithm`` / ``OPSDAlgorithm`` / ``TrainingSample`` source (AST) and
  checks the contract composer_prime_rl relies on: the async ``setup`` / ``score_episode`` / ``score_group``
  hooks, ``action_loss_type``, opsd's ``pool.score(hint_block + branch.token_ids)`` call, and
  ``TrainingSample``'s field names in order (the converter's mirror).
Otherwise it is skipped (CI).
"""

from __future__ import annotations

import ast
import dataclasses
import importlib.util
import os
import sys
import types
from pathlib import Path

import pytest

SRC = os.environ.get("PRIME_RL_SRC")
pytestmark = pytest.mark.skipif(
    not SRC, reason="PRIME_RL_SRC is unset (prime-rl is not on the package index)"
)


def _file(rel: str) -> Path:
    path = Path(SRC or "") / rel
    if not path.is_file():
        pytest.fail(f"PRIME_RL_SRC={SRC} has no {rel}")
    return path


def _classes(rel: str) -> dict[str, ast.ClassDef]:
    tree = ast.parse(_file(rel).read_text())
    return {n.name: n for n in tree.body if isinstance(n, ast.ClassDef)}


def _load_routing() -> types.ModuleType:
    stubs = {
        name: types.ModuleType(name)
        for name in (
            "verifiers",
            "verifiers.v1",
            "prime_rl",
            "prime_rl.configs",
            "prime_rl.configs.algorithm",
            "prime_rl.transports",
            "prime_rl.transports.rollouts",
        )
    }
    stubs["prime_rl.configs.algorithm"].ActionLossType = str
    stubs["prime_rl.transports.rollouts"].TrainingSample = object
    saved = {k: sys.modules.get(k) for k in stubs}
    for k, v in stubs.items():
        sys.modules.setdefault(k, v)
    try:
        spec = importlib.util.spec_from_file_location(
            "_prime_rl_routing", _file("src/prime_rl/orchestrator/algo/routing.py")
        )
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    finally:
        for k, v in saved.items():
            if v is None:
                sys.modules.pop(k, None)


def test_assign_reference_logprobs_matches_upstream() -> None:
    from composer_prime_rl import orchestrator

    if orchestrator.HAS_PRIME_RL_ORCHESTRATOR:
        pytest.skip("prime_rl is importable: composer_prime_rl uses upstream's function itself")
    routing = _load_routing()

    @dataclasses.dataclass
    class Node:
        token_ids: list[int]
        mask: list[bool]
        reference_logprobs: list[float] | None = None

    @dataclasses.dataclass
    class Branch:
        nodes: list[Node]

        @property
        def token_ids(self) -> list[int]:
            return [t for n in self.nodes for t in n.token_ids]

    def graph() -> Branch:
        return Branch([Node([1, 2], [False, False]), Node([3, 4, 5], [True, False, True]), Node([6], [True])])

    values = [-0.1, -0.2, -0.3, -0.4, -0.5, -0.6]
    ours, theirs = graph(), graph()
    orchestrator.assign_reference_logprobs(ours, values)
    routing.assign_reference_logprobs(theirs, values)
    assert [n.reference_logprobs for n in ours.nodes] == [n.reference_logprobs for n in theirs.nodes]
    assert ours.nodes[1].reference_logprobs == [-0.3, -0.5]
    with pytest.raises(ValueError):
        routing.assign_reference_logprobs(graph(), values[:-1])
    with pytest.raises(ValueError):
        orchestrator.assign_reference_logprobs(graph(), values[:-1])


def test_algorithm_hooks_and_opsd_scoring_contract() -> None:
    base = _classes("src/prime_rl/orchestrator/algo/base.py")["Algorithm"]
    hooks = {n.name for n in base.body if isinstance(n, ast.AsyncFunctionDef)}
    assert {"setup", "score_episode", "score_group"} <= hooks
    assert "action_loss_type" in ast.unparse(base)
    assert "GRPOAlgorithm" in _classes("src/prime_rl/orchestrator/algo/grpo.py")
    opsd = ast.unparse(_classes("src/prime_rl/orchestrator/algo/opsd.py")["OPSDAlgorithm"])
    assert "pool.score(hint_block + branch.token_ids)" in opsd
    assert "assign_reference_logprobs(branch, full_logprobs[len(hint_block):])" in opsd
    registry = _file("src/prime_rl/orchestrator/algo/__init__.py").read_text()
    assert "ALGORITHM_CLASSES: dict[str, type[Algorithm]]" in registry  # what install() extends


def test_training_sample_fields_match_the_converter_mirror() -> None:
    from composer_prime_rl import records_to_samples as conv

    cls = _classes("src/prime_rl/transports/rollouts/types.py")["TrainingSample"]
    upstream = [
        n.target.id for n in cls.body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)
    ]
    if conv.HAS_PRIME_RL_TRANSPORT:
        pytest.skip("prime_rl is importable: the converter uses upstream's class itself")
    assert upstream == [f.name for f in dataclasses.fields(conv.TrainingSample)]
