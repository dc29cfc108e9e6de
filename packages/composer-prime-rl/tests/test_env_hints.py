"""composer_sdpo's environment hint source (``hint_env = "verifiers:<module>"``), without PRIME-RL.

PRIME-RL's environments are verifiers environments; its orchestrator holds verifiers ``Trace`` s. These tests
build real ``vf.Trace`` s of the fixture env (tests/fixtures/composer-vf-digits in composer-core) with token ids
on their nodes, and check that the hinted self-scoring uses that env's feedback on each trace.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

import pytest
import verifiers.v1 as vf
from composer_core.tasks import digit_reversal as dr
from composer_prime_rl.orchestrator import ComposerSDPOAlgorithm, ComposerSDPOSettings
from verifiers.v1.graph import MessageNode
from verifiers.v1.trace import AgentInfo, TraceTask
from verifiers.v1.utils.loaders import load_taskset, taskset_config_type

ENV = "verifiers:composer_vf_digits"


class Renderer:
    def render_ids(self, messages: list[dict[str, str]], add_generation_prompt: bool) -> list[int]:
        return [ord(c) for m in messages for c in m["content"]]


class Pool:
    model_name = "policy"

    def __init__(self) -> None:
        self.calls: list[list[int]] = []

    async def score(self, token_ids: list[int]) -> list[float]:
        self.calls.append(list(token_ids))
        return [-(t % 7) / 10 for t in token_ids]


@dataclass
class Config:
    hint_env: str | None = ENV
    hint_fn: str | None = None
    template: str = "{hint}"
    renderer_instance: Any = field(default_factory=Renderer)


@dataclass
class Episode:
    traces: list[Any]


def vf_trace(task: vf.Task, reply: str) -> vf.Trace:
    """A finished verifiers trace: the prompt node (not sampled) and the reply node (sampled tokens)."""
    prompt = str(task.data.prompt)
    return vf.Trace(
        task=TraceTask(type=type(task).__name__, data=task.data, key=task.key, hash=task.hash),
        agent=AgentInfo(config=vf.AgentConfig()),
        is_completed=True,
        ok=True,
        nodes=[
            MessageNode(
                message=vf.UserMessage(content=prompt),
                token_ids=dr.encode(prompt),
                mask=[False] * len(prompt),
            ),
            MessageNode(
                parent=0,
                message=vf.AssistantMessage(content=reply),
                sampled=True,
                token_ids=dr.encode(reply),
                mask=[True] * len(reply),
            ),
        ],
    )


@pytest.fixture(scope="module")
def tasks() -> list[vf.Task]:
    return list(load_taskset(taskset_config_type("composer_vf_digits")(id="composer_vf_digits", num_tasks=3)))


def test_env_feedback_is_the_hint_of_each_trace(tasks: list[vf.Task]) -> None:
    pool = Pool()
    algo = ComposerSDPOAlgorithm(Config(), pool)
    wrong_task, right_task = tasks[0], tasks[1]
    prompt = str(wrong_task.data.prompt)
    wrong = dr.wrong_solution(prompt)
    hinted, plain = vf_trace(wrong_task, wrong), vf_trace(right_task, str(right_task.data.answer))
    for trace in (hinted, plain):
        asyncio.run(algo.score_episode(Episode([trace])))
    hint = dr.feedback_hint(prompt, wrong)
    assert hint is not None
    block = [ord(c) for c in hint]
    tokens = dr.encode(prompt) + dr.encode(wrong)
    assert pool.calls == [block + tokens]  # only the wrong reply is re-scored, after the env's feedback
    expected = [-(t % 7) / 10 for t in tokens]
    assert hinted.nodes[1].reference_logprobs == expected[len(prompt) :]
    assert hinted.nodes[0].reference_logprobs is None and plain.nodes[1].reference_logprobs is None
    assert (
        "feedback" not in hinted.info and hinted.rewards == {}
    )  # the orchestrator's trace is left as it was


def test_env_hint_is_exclusive_with_hint_fn() -> None:
    with pytest.raises(ValueError, match="not both"):
        ComposerSDPOSettings(hint_fn="m.f", hint_env=ENV)
    with pytest.raises(ValueError, match="--env"):
        ComposerSDPOAlgorithm(Config(hint_env="nope"), Pool())
