"""composer_sdpo with the teacher context built from the rollout group (SDPO's successful siblings and/or the
environment's feedback), through the orchestrator's own path, on verifier-graph stand-ins (no PRIME-RL)."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import pytest
from composer_core.sdpo.context import TeacherContextOptions
from composer_prime_rl.orchestrator import ComposerSDPOAlgorithm, ComposerSDPOSettings
from composer_testkit.teacher_context import check_teacher_context


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
    nodes: list[Node]
    reward: float
    info: dict[str, Any] = field(default_factory=dict)
    has_error: bool = False
    agent: Agent = field(default_factory=Agent)
    prompt: Any = None

    @property
    def branches(self) -> list[Branch]:
        return [Branch(self.nodes)]


@dataclass
class Episode:
    traces: list[Trace]


class CharTokenizer:
    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(chr(i) for i in ids)


class Renderer:
    tokenizer = CharTokenizer()

    def render_ids(self, messages: list[dict[str, Any]], add_generation_prompt: bool) -> list[int]:
        ids = [ord(c) for m in messages for c in m["content"]]
        return [7, *ids, 8] if add_generation_prompt else ids


class Pool:
    model_name = "policy"

    def __init__(self) -> None:
        self.calls: list[list[int]] = []

    async def score(self, token_ids: list[int]) -> list[float]:
        self.calls.append(list(token_ids))
        return [-(t % 7) / 10 for t in token_ids]


def enc(text: str) -> list[int]:
    return [ord(c) for c in text]


def trace(prompt: Any, completion: str, reward: float, info: dict[str, Any] | None = None) -> Trace:
    chat = isinstance(prompt, list)
    text = "".join(m["content"] for m in prompt) if chat else prompt
    return Trace(
        [Node(enc(text), [False] * len(text)), Node(enc(completion), [True] * len(completion))],
        reward,
        info or {},
        prompt=prompt if chat else None,
    )


def config(options: TeacherContextOptions, **kw: Any) -> dict[str, Any]:
    fields = TeacherContextOptions.__dataclass_fields__
    return {k: getattr(options, k) for k in fields} | {"renderer_instance": Renderer()} | kw


class _Cfg(dict[str, Any]):
    def __getattr__(self, k: str) -> Any:
        try:
            return self[k]
        except KeyError as exc:
            raise AttributeError(k) from exc


def algorithm(options: TeacherContextOptions, pool: Pool | None = None, **kw: Any) -> ComposerSDPOAlgorithm:
    cfg = _Cfg(config(options, **kw))
    algo = ComposerSDPOAlgorithm(cfg, pool or Pool())
    algo.renderer = cfg["renderer_instance"]
    return algo


def build(
    prompts: Sequence[Any],
    completions: Sequence[str],
    rewards: Sequence[float],
    group_size: int,
    feedback: Sequence[str | None] | None,
    options: TeacherContextOptions,
) -> tuple[list[Any], list[bool]]:
    """The orchestrator's path: one score_group call per rollout group, contexts read from its output."""
    algo = algorithm(options)
    contexts: list[Any] = []
    mask: list[bool] = []
    for g in range(0, len(prompts), group_size):
        rows = range(g, g + group_size)
        episodes = [
            Episode(
                [trace(prompts[i], completions[i], rewards[i], {"feedback": feedback[i]} if feedback else {})]
            )
            for i in rows
        ]
        _, built = algo.teacher_contexts(episodes)
        contexts += built.contexts
        mask += built.mask
    return contexts, mask


def test_conformance_through_the_orchestrator_path() -> None:
    assert len(check_teacher_context(build)) >= 3


def test_success_sibling_is_the_teacher_context_of_a_failed_trace() -> None:
    pool = Pool()
    opts = TeacherContextOptions(
        sdpo_teacher_context="success",
        reprompt_template="{prompt}|{solution}",
        solution_template="[{demonstration}]",
    )
    algo = algorithm(opts, pool)
    failed, ok = trace("P:", "no", 0.0), trace("P:", "yes", 1.0)
    other = [trace("Q:", "x", 1.0), trace("Q:", "y", 0.0)]
    asyncio.run(algo.score_episode(Episode([failed])))
    assert pool.calls == []  # the group source waits for score_group
    asyncio.run(algo.score_group([Episode([failed]), Episode([ok])]))
    block = [7, *enc("P:|[yes]"), 8]
    assert pool.calls == [block + enc("no")]  # the failed trace only; the success is not reprompted on itself
    assert failed.nodes[1].reference_logprobs == [-(t % 7) / 10 for t in enc("no")]
    assert ok.nodes[1].reference_logprobs is None  # masked out: no ref_logprobs, channel 1 only
    assert failed.nodes[1].advantages == [-0.5, -0.5] and ok.nodes[1].advantages == [0.5] * 3
    # a second group: its own success ("x") is the demonstration, never the first group's
    asyncio.run(algo.score_group([Episode([t]) for t in other]))
    assert pool.calls[-1] == [7, *enc("Q:|[x]"), 8, *enc("y")]
    assert other[0].nodes[1].reference_logprobs is None


def test_feedback_comes_from_trace_info_and_groups_without_context_are_masked() -> None:
    pool = Pool()
    opts = TeacherContextOptions(
        sdpo_teacher_context="feedback",
        reprompt_template="{prompt}{feedback}",
        feedback_template="<{feedback}>",
    )
    algo = algorithm(opts, pool, hint_key="critique")
    a, b = trace("P:", "no", 0.0, {"critique": "off by one"}), trace("P:", "no", 0.0, {})
    asyncio.run(algo.score_group([Episode([a]), Episode([b])]))
    assert pool.calls == [[7, *enc("P:<off by one>"), 8, *enc("no")]]
    assert b.nodes[1].reference_logprobs is None


def test_chat_prompt_renders_the_reprompted_messages() -> None:
    pool = Pool()
    opts = TeacherContextOptions(
        sdpo_teacher_context="success",
        reprompt_template="{prompt}|{solution}",
        solution_template="[{demonstration}]",
    )
    chat = [{"role": "system", "content": "S"}, {"role": "user", "content": "P"}]
    failed, ok = trace(chat, "no", 0.0), trace(chat, "yes", 1.0)
    asyncio.run(algorithm(opts, pool).score_group([Episode([failed]), Episode([ok])]))
    assert pool.calls == [[7, *enc("S"), *enc("P|[yes]"), 8, *enc("no")]]  # system kept, user turn reprompted


def test_bad_options_and_inputs_raise_one_line() -> None:
    for bad in ("ema", "base"):
        with pytest.raises(ValueError, match=rf"sdpo_teacher='{bad}'.*live") as err:
            ComposerSDPOSettings(sdpo_teacher=bad)
        assert "\n" not in str(err.value)
    with pytest.raises(ValueError, match="sdpo_teacher_context"):
        ComposerSDPOSettings.from_config({"sdpo_teacher_context": "siblings"})
    with pytest.raises(ValueError, match="feedback"):  # feedback source without any: none in the group
        algo = algorithm(TeacherContextOptions(sdpo_teacher_context="feedback"), hint_key="x")
        bad_trace = trace("P:", "no", 0.0, {"x": 3})
        asyncio.run(algo.score_group([Episode([bad_trace])]))
    algo = algorithm(TeacherContextOptions(sdpo_teacher_context="success"))
    algo.renderer = object()
    with pytest.raises(RuntimeError, match=r"tokenizer\.decode"):
        asyncio.run(algo.score_group([Episode([trace("P:", "no", 0.0)])]))


@pytest.mark.parametrize("source", ["success", "hint"])
def test_max_reprompt_len_caps_the_teacher_prompt(source: str) -> None:
    """max_reprompt_len=5: every teacher prompt the policy scores keeps its last 5 tokens (issue 60 saw 9–15 here,
    as TRL and verl cut to 5), and the ref log-probs still land on the completion tokens."""
    pool = Pool()
    if source == "success":
        opts = TeacherContextOptions(sdpo_teacher_context="success", max_reprompt_len=5)
        failed, ok = trace("Prompt:", "no", 0.0), trace("Prompt:", "yes", 1.0)
        asyncio.run(algorithm(opts, pool).score_group([Episode([failed]), Episode([ok])]))
        full = [7, *enc(opts.reprompt_template.format(prompt="Prompt:", solution="", feedback=""))]
        assert len(full) > 5
    else:
        opts = TeacherContextOptions(max_reprompt_len=5)
        failed = trace("Prompt:", "no", 0.0, {"feedback": "carry the one"})
        asyncio.run(algorithm(opts, pool).score_episode(Episode([failed])))
    assert len(pool.calls) == 1
    head, tail = pool.calls[0][:-2], pool.calls[0][-2:]
    assert len(head) == 5 and tail == enc("no")
    if source == "hint":
        assert head == enc("ompt:")  # the hint block went first: the prompt's end stays
    assert failed.nodes[1].reference_logprobs == [-(t % 7) / 10 for t in enc("no")]


def test_demo_pick_random_is_seeded_per_group() -> None:
    """demo_pick='random' draws per group from the `seed` option and the group itself: two runs pick the same
    demonstrations, another seed picks others, and the groups do not all pick the same position."""
    opts = TeacherContextOptions(
        sdpo_teacher_context="success", demo_pick="random", dont_reprompt_on_self_success=False
    )
    groups = [
        [trace(f"P{g}:", c, 1.0 if c != "x" else 0.0) for c in ("a", "b", "c", "d", "x")] for g in range(12)
    ]

    def picks(seed: int) -> list[int | None]:
        algo = algorithm(opts, seed=seed)
        return [algo.teacher_contexts([Episode([t]) for t in group])[1].demo_index[-1] for group in groups]

    first = picks(1)
    assert first == picks(1)  # reproducible
    assert first != picks(2)  # the seed is read
    assert len(set(first)) > 1  # each group draws for itself
