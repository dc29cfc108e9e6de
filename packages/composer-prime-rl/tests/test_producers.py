"""Unit tests of the PRIME-RL producers (no PRIME-RL needed): the composer_sdpo algorithm's hinted
self-scoring and group advantages on verifier-graph stand-ins, and the records -> samples converter."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from composer_prime_rl.orchestrator import ComposerSDPOAlgorithm, ComposerSDPOSettings, trace_hint_jobs
from composer_prime_rl.records_to_samples import pair_samples, records_to_samples


@dataclass
class Node:
    token_ids: list[int]
    mask: list[bool]
    advantages: list[float] | None = None
    reference_logprobs: list[float] | None = None


@dataclass
class Branch:
    nodes: list[Node]

    @property
    def token_ids(self) -> list[int]:
        return [t for n in self.nodes for t in n.token_ids]


@dataclass
class Agent:
    trainable: bool = True


@dataclass
class Trace:
    id: str
    nodes: list[Node]
    reward: float
    info: dict[str, Any] = field(default_factory=dict)
    has_error: bool = False
    agent: Agent = field(default_factory=Agent)

    @property
    def branches(self) -> list[Branch]:
        return [Branch(self.nodes)]


@dataclass
class Episode:
    traces: list[Trace]


class Renderer:
    def render_ids(self, messages: list[dict[str, str]], add_generation_prompt: bool) -> list[int]:
        assert not add_generation_prompt
        return [900 + len(m["role"]) for m in messages] + [ord(c) for m in messages for c in m["content"]]


class Pool:
    model_name = "policy"

    def __init__(self) -> None:
        self.calls: list[list[int]] = []

    async def score(self, token_ids: list[int]) -> list[float]:
        self.calls.append(list(token_ids))
        return [-(t % 7) / 10 for t in token_ids]  # a deterministic per-token "log-prob"


@dataclass
class Config:
    hint_key: str = "feedback"
    hint_fn: str | None = None
    hint_role: str = "system"
    template: str = "Hint: {hint}"
    renderer_instance: Any = field(default_factory=Renderer)


def trace(tid: str, reward: float, info: dict[str, Any]) -> Trace:
    # prompt node (not sampled), action node (sampled), tool node (not sampled), action node (sampled)
    return Trace(
        tid,
        [Node([1, 2], [False, False]), Node([3, 4], [True, True]), Node([5], [False]), Node([6], [True])],
        reward,
        info,
    )


def test_hinted_scores_become_ref_logprobs_and_grpo_advantages_stay() -> None:
    pool = Pool()
    algo = ComposerSDPOAlgorithm(Config(), pool)
    assert algo.action_loss_type == "rl"  # both signals go to the rl loss (composer_loss)
    hinted, plain = trace("a", 1.0, {"feedback": "wrong unit"}), trace("b", 0.0, {})
    episodes = [Episode([hinted]), Episode([plain])]
    for ep in episodes:
        asyncio.run(algo.score_episode(ep))
    asyncio.run(algo.score_group(episodes))

    block = Renderer().render_ids(
        [{"role": "system", "content": "Hint: wrong unit"}], add_generation_prompt=False
    )
    assert pool.calls == [[*block, 1, 2, 3, 4, 5, 6]]  # one scoring call, the hinted trace only
    expected = [-(t % 7) / 10 for t in [1, 2, 3, 4, 5, 6]]
    assert hinted.nodes[1].reference_logprobs == expected[2:4]  # sampled tokens only, hint block dropped
    assert hinted.nodes[3].reference_logprobs == expected[5:6]
    assert hinted.nodes[0].reference_logprobs is None and plain.nodes[1].reference_logprobs is None
    assert hinted.nodes[1].advantages == [0.5, 0.5] and plain.nodes[3].advantages == [-0.5]


def resolve_hint(s: ComposerSDPOSettings, hint_fn: Any, episode: Any, t: Any) -> str | None:
    """The hint text of one trace (None: no hint), as the orchestrator's ``trace_hint_jobs`` gives it."""
    jobs = trace_hint_jobs(s, hint_fn, episode, [t])
    return jobs[0].hint if jobs else None


def test_hint_sources_and_errors() -> None:
    s = ComposerSDPOSettings(template="{hint}")
    t = trace("a", 0.0, {"feedback": "  "})
    assert resolve_hint(s, None, None, t) is None  # empty feedback = no hint
    assert resolve_hint(s, lambda ep, tr: "from fn", None, t) == "from fn"
    with pytest.raises(ValueError, match="answered int"):
        resolve_hint(s, lambda ep, tr: 3, None, t)
    with pytest.raises(ValueError, match="hint_role"):
        ComposerSDPOSettings(hint_role="assistant")
    with pytest.raises(ValueError, match="template"):
        ComposerSDPOSettings(template="no placeholder")
    with pytest.raises(ValueError, match="hint_fn"):
        ComposerSDPOAlgorithm(Config(hint_fn="composer_prime_rl.nope"), Pool())


class CharTokenizer:
    chat_template = None

    def __call__(
        self, text: str, add_special_tokens: bool = False, return_offsets_mapping: bool = False
    ) -> dict:
        ids = [ord(c) for c in text]
        out: dict[str, Any] = {"input_ids": ids}
        if return_offsets_mapping:
            out["offset_mapping"] = [(i, i + 1) for i in range(len(text))]
        return out


def record(i: int) -> Any:
    from composer_core.traces.records import TraceRecord

    completion = [{"role": "assistant", "content": "no"}]
    return TraceRecord(
        id=f"e{i}@1",
        episode_id=f"e{i}",
        turn=1,
        prompt=[{"role": "user", "content": "q"}],
        completion=completion,
        chosen=[{"role": "assistant", "content": "yes"}],
        rejected=completion,
    )


def test_ce_mode_replays_the_chosen_action_as_supervised_tokens() -> None:
    (s,) = pair_samples(record(0), CharTokenizer(), env_name="env")
    n_action = sum(s.mask)
    assert [chr(t) for t, m in zip(s.token_ids, s.mask, strict=True) if m] == list("yes\n<|end|>\n")
    assert s.ce_weights == [1.0 if m else 0.0 for m in s.mask] and sum(s.ce_weights) == n_action
    assert s.rl_weights == [0.0] * len(s.token_ids) and s.advantages is None
    assert len(s.logprobs) == len(s.temperatures) == len(s.token_ids)


def test_rl_pair_mode_needs_a_scorer_and_signs_the_advantages() -> None:
    with pytest.raises(ValueError, match="scorer"):
        pair_samples(record(0), CharTokenizer(), env_name="env", mode="rl_pair")
    chosen, rejected = pair_samples(
        record(0),
        CharTokenizer(),
        env_name="env",
        mode="rl_pair",
        margin=0.5,
        scorer=lambda ids: [-0.1] * len(ids),
    )
    assert {a for a, m in zip(chosen.advantages, chosen.mask, strict=True) if m} == {0.5}
    assert {a for a, m in zip(rejected.advantages, rejected.mask, strict=True) if m} == {-0.5}
    assert [chr(t) for t, m in zip(rejected.token_ids, rejected.mask, strict=True) if m][:2] == ["n", "o"]
    assert chosen.logprobs == [-0.1] * len(chosen.token_ids)
    with pytest.raises(ValueError, match="log-probs"):
        pair_samples(record(0), CharTokenizer(), env_name="env", mode="rl_pair", scorer=lambda ids: [0.0])


def test_records_file_to_samples(tmp_path: Path) -> None:
    from composer_core.traces.records import write_records

    path = tmp_path / "records.jsonl"
    write_records([record(0), record(1)], path)
    samples = records_to_samples(path, CharTokenizer(), env_name="env")
    assert len(samples) == 2 and all(s.env_name == "env" for s in samples)
    with pytest.raises(ValueError, match="no record carries a pair"):
        records_to_samples([], CharTokenizer(), env_name="env")
