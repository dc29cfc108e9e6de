"""composer_core.envs.verifiers against the real verifiers (0.4) and the fixture envs (tests/fixtures/composer-vf-digits).

``composer_vf_digits`` is single-turn (a ``Taskset`` whose task has one ``@vf.reward``), ``composer_vf_digits_retry``
multi-turn (its ``Env.run`` answers a wrong reply with the feedback and lets the solver retry).
"""

from __future__ import annotations

import asyncio
import random
import time

import pytest
import verifiers.v1 as vf
from composer_core.envs.base import EnvError, EnvTask
from composer_core.envs.episodes import episode_error_sites, episode_records, run_episode
from composer_core.envs.verifiers import VerifiersEnvironment
from composer_core.tasks import digit_reversal as dr
from composer_core.traces.records import TraceRecord
from verifiers.v1.graph import MessageNode
from verifiers.v1.trace import AgentInfo, TraceTask
from verifiers.v1.utils.loaders import load_taskset, taskset_config_type

SINGLE = "composer_vf_digits"
MULTI = "composer_vf_digits_retry"


@pytest.fixture(scope="module")
def single() -> VerifiersEnvironment:
    return VerifiersEnvironment(SINGLE, taskset_args={"num_tasks": 6})


@pytest.fixture(scope="module")
def multi() -> VerifiersEnvironment:
    return VerifiersEnvironment(MULTI, taskset_args={"num_tasks": 4}, env_args={"max_attempts": 3})


def _verifiers_score(task: vf.Task, completion: str) -> tuple[float, str | None]:
    """verifiers' own scoring of one completion, on a trace built here (not through the adapter)."""
    trace = vf.Trace(
        task=TraceTask(type=type(task).__name__, data=task.data, key=task.key, hash=task.hash),
        agent=AgentInfo(config=vf.AgentConfig()),
        nodes=[
            MessageNode(message=vf.UserMessage(content=task.data.prompt)),
            MessageNode(parent=0, message=vf.AssistantMessage(content=completion), sampled=True),
        ],
    )
    asyncio.run(task.score(trace))
    return trace.reward, trace.info.get("feedback")


def test_tasks_come_from_the_taskset_with_the_answer_as_reference(single: VerifiersEnvironment) -> None:
    tasks = single.tasks()
    rows = dr.make_dataset_rows(6, seed=0)
    assert [t.prompt for t in tasks] == [r["prompt"] for r in rows]
    assert [t.reference for t in tasks] == [r["chosen"] for r in rows]
    assert [t.task_id for t in tasks] == [f"digits-{i}" for i in range(6)]
    assert [t.info["rejected"] for t in tasks] == [r["rejected"] for r in rows]  # the env's own task field
    assert len(single.tasks(limit=2)) == 2
    assert not single.multi_turn and multi_is_multi()


def multi_is_multi() -> bool:
    return VerifiersEnvironment(MULTI, taskset_args={"num_tasks": 1}).multi_turn


def test_single_turn_rewards_equal_verifiers_own_scoring(single: VerifiersEnvironment) -> None:
    cfg = taskset_config_type(SINGLE)(id=SINGLE, num_tasks=6)
    vf_tasks = list(load_taskset(cfg))
    rng = random.Random(0)
    seen = set()
    for task, vf_task in zip(single.tasks(), vf_tasks, strict=True):
        ref = task.reference
        assert ref is not None
        wrong = "".join(rng.choice(dr.DIGITS) for _ in range(rng.randint(1, 5)))
        for completion in (ref, ref[:-1] + "x", wrong, "", ref[::-1]):
            result = single.reset(task).step(completion)
            theirs, their_feedback = _verifiers_score(vf_task, completion)
            assert result.done
            assert result.reward == theirs == pytest.approx(dr.verify(str(task.prompt), completion), abs=0)
            assert result.feedback == their_feedback == dr.feedback_hint(str(task.prompt), completion)
            assert result.info["rewards"] == {"digit_accuracy": theirs}
            seen.add(round(result.reward, 3))
    assert {0.0, 1.0} <= seen and len(seen) >= 3  # exact, wrong and partial credit all occurred


def test_single_turn_session_is_one_step(single: VerifiersEnvironment) -> None:
    task = single.tasks()[0]
    session = single.reset(task)
    session.step("1")
    with pytest.raises(EnvError, match="episode is over"):
        session.step("2")


def test_single_turn_episode_records_have_the_error_site_at_the_feedback(
    single: VerifiersEnvironment,
) -> None:
    task = single.tasks()[1]
    wrong = dr.wrong_solution(str(task.prompt))
    ep = run_episode(single, task, lambda msgs: wrong)
    assert ep.failed is None and len(ep.steps) == 1
    assert ep.reward == dr.verify(str(task.prompt), wrong) < 1
    (site,) = episode_error_sites(ep)
    assert site.evidence == dr.feedback_hint(str(task.prompt), wrong)
    assert ep.episode.messages[site.action_turn].text == wrong
    assert ep.episode.messages[site.turn].text == site.evidence
    (record,) = episode_records(ep)
    assert isinstance(record, TraceRecord) and record.has_sdpo and record.has_pair
    assert record.hint is not None and record.hint.endswith(site.evidence)
    assert record.error_kinds == ["env_feedback"] and record.turn == site.action_turn
    assert record.chosen is not None and record.chosen[0]["content"] == task.reference
    assert record.rejected is not None and record.rejected[0]["content"] == wrong
    right = run_episode(single, task, lambda msgs: str(task.reference))
    assert right.reward == 1.0 and episode_error_sites(right) == [] and episode_records(right) == []


def test_multi_turn_env_replies_are_feedback_steps_and_the_last_reply_is_scored(
    multi: VerifiersEnvironment,
) -> None:
    task = multi.tasks()[2]
    prompt, ref = str(task.prompt), str(task.reference)
    replies = iter(["000", ref[:-1] + "0", ref])
    ep = run_episode(multi, task, lambda msgs: next(replies))
    assert ep.failed is None
    assert [s.done for s in ep.steps] == [False, False, True]
    assert [s.reward for s in ep.steps] == [0.0, 0.0, 1.0] and ep.reward == 1.0
    assert [s.feedback for s in ep.steps] == [
        dr.feedback_hint(prompt, "000"),
        dr.feedback_hint(prompt, ref[:-1] + "0"),
        None,
    ]
    sites = episode_error_sites(ep)
    assert [s.evidence for s in sites] == [ep.steps[0].feedback, ep.steps[1].feedback]
    # the env's reply follows the action it answers, as the next user turn of the chat
    for s in sites:
        assert ep.episode.messages[s.turn].role == "user" and s.turn == s.action_turn + 1
    records = episode_records(ep)
    assert [r.turn for r in records] == [s.action_turn for s in sites]
    assert all(r.has_sdpo and r.has_pair for r in records)


def test_multi_turn_runs_out_of_attempts_with_terminal_feedback(multi: VerifiersEnvironment) -> None:
    task = multi.tasks()[0]
    prompt = str(task.prompt)
    ep = run_episode(multi, task, lambda msgs: "9")
    assert [s.done for s in ep.steps] == [False, False, True]  # max_attempts=3
    assert ep.steps[-1].reward == dr.verify(prompt, "9")
    assert ep.steps[-1].feedback == dr.feedback_hint(prompt, "9")
    assert len(episode_error_sites(ep)) == 3


def test_multi_turn_session_closes_midway(multi: VerifiersEnvironment) -> None:
    task = multi.tasks()[1]
    session = multi.reset(task)
    assert session.step("1").done is False
    session.close()
    with pytest.raises(EnvError, match="episode is over"):
        session.step("2")


def test_bad_module_names_env_and_fix() -> None:
    with pytest.raises(ValueError, match="--env verifiers:no_such_vf_env"):
        VerifiersEnvironment("no_such_vf_env")


def test_split_and_unused_env_args_raise(single: VerifiersEnvironment) -> None:
    with pytest.raises(ValueError, match="one task stream"):
        single.tasks("test")
    with pytest.raises(ValueError, match="env_args"):
        VerifiersEnvironment(SINGLE, env_args={"max_attempts": 2})


def test_unknown_task_is_an_env_error(single: VerifiersEnvironment) -> None:
    with pytest.raises(EnvError, match="unknown task_id"):
        single.reset(EnvTask("nope", "1>"))


def test_multi_turn_env_faults_are_failed_episodes_in_bounded_time(monkeypatch: pytest.MonkeyPatch) -> None:
    env = VerifiersEnvironment(MULTI, taskset_args={"num_tasks": 1}, timeout_s=2.0)
    task = env.tasks()[0]

    async def broken(vf_task: vf.Task, agents: vf.Agents) -> None:
        async with agents.solver.interaction(vf_task) as chat:
            await chat.turn()
            raise RuntimeError("env exploded")

    monkeypatch.setattr(env.vf_env, "run", broken)
    ep = run_episode(env, task, lambda msgs: "1")
    assert ep.failed is not None and "env exploded" in ep.failed and ep.steps == ()

    async def hangs(vf_task: vf.Task, agents: vf.Agents) -> None:
        async with agents.solver.interaction(vf_task) as chat:
            await chat.turn()
            await asyncio.sleep(3600)

    monkeypatch.setattr(env.vf_env, "run", hangs)
    t0 = time.monotonic()
    ep = run_episode(env, task, lambda msgs: "1")
    assert ep.failed is not None and "timeout_s=2" in ep.failed and time.monotonic() - t0 < 15
