"""The environment contract (composer_core.envs): closed-form rewards, episodes -> records, registry errors."""

from __future__ import annotations

import importlib.util
import time
from collections.abc import Sequence

import pytest
from composer_core.envs import (
    DigitReversalEnv,
    EnvEpisode,
    EnvError,
    Environment,
    EnvTask,
    StepResult,
    env_dataset_rows,
    env_hint_func,
    env_reward_func,
    episode_error_sites,
    episode_from_steps,
    episode_records,
    feedback_hint,
    load_env,
    run_episode,
)
from composer_core.traces.hints import build_hinted_context
from composer_core.traces.records import records_from_rows
from composer_core.traces.schema import Message


def _replay(actions: Sequence[str]):
    it = iter(actions)
    return lambda messages: next(it)


# --- the embedded task as an environment -----------------------------------------------------


def test_digit_reversal_env_rewards_are_closed_form() -> None:
    env = load_env("digit-reversal")
    task = env.task("train:381")  # type: ignore[attr-defined]
    assert task.prompt == "381>" and task.reference == "183" and task.info["rejected"] == "381"
    # verify(): #{i: c[i] == a[i]} / max(len(c), len(a))
    for action, reward, feedback in [
        ("183", 1.0, None),
        ("133", 2 / 3, ".8.|"),
        ("1834", 3 / 4, "...|"),
        ("", 0.0, "183|"),
    ]:
        step = env.reset(task).step(action)
        assert step.done and step.reward == pytest.approx(reward, abs=1e-12) and step.feedback == feedback


def test_digit_reversal_env_tasks_are_reproducible_and_splits_differ() -> None:
    env = DigitReversalEnv(n_tasks=8, seed=3)
    train, again, test = env.tasks("train"), env.tasks("train"), env.tasks("test")
    assert [t.task_id for t in train] == [t.task_id for t in again]
    assert {t.prompt for t in train} != {t.prompt for t in test}
    assert len(env.tasks("train", limit=3)) == 3
    with pytest.raises(ValueError, match="splits"):
        env.tasks("validation")


def test_trl_funcs_reward_hint_and_rows() -> None:
    env = DigitReversalEnv(n_tasks=4, seed=1)
    rows = env_dataset_rows(env, "train")
    assert set(rows[0]) == {"prompt", "task_id", "chosen", "rejected"}
    prompts = [r["prompt"] for r in rows]
    completions = [r["chosen"] for r in rows[:2]] + [r["rejected"] for r in rows[2:]]
    ids = [r["task_id"] for r in rows]
    reward, hint = env_reward_func(env), env_hint_func(env)
    assert reward.__name__ == "env_reward_digit_reversal"
    rewards = reward(prompts=prompts, completions=completions, task_id=ids)
    from composer_core.tasks.digit_reversal import feedback_hint as dr_hint
    from composer_core.tasks.digit_reversal import verify

    assert rewards == [verify(p, c) for p, c in zip(prompts, completions)]
    assert rewards[:2] == [1.0, 1.0] and all(r < 1.0 for r in rewards[2:])
    hints = hint(prompts=prompts, completions=completions, task_id=ids)
    assert hints == [dr_hint(p, c) for p, c in zip(prompts, completions)]
    assert hints[:2] == [None, None] and all(h and h.endswith("|") for h in hints[2:])
    # conversational completions (TRL passes [{"role": "assistant", "content": ...}])
    chat = [[{"role": "assistant", "content": c}] for c in completions]
    assert reward(prompts=prompts, completions=chat, task_id=ids) == rewards


def test_reward_and_hint_share_one_step_per_completion() -> None:
    calls: list[str] = []

    class Counting(DigitReversalEnv):
        def reset(self, task: EnvTask):  # type: ignore[override]
            session = super().reset(task)
            step = session.step

            def counted(action: str) -> StepResult:
                calls.append(action)
                return step(action)

            session.step = counted  # type: ignore[method-assign]
            return session

    env = Counting(n_tasks=2)
    rows = env_dataset_rows(env)
    kw = {
        "prompts": [r["prompt"] for r in rows],
        "completions": ["000", "111"],
        "task_id": [r["task_id"] for r in rows],
    }
    env_reward_func(env)(**kw)
    env_hint_func(env)(**kw)
    assert calls == ["000", "111"]  # the hint reused the reward's step


def test_scorer_timeout_bounds_a_slow_step() -> None:
    env = _Faulty("slow")
    rows = env_dataset_rows(env)  # registers the task; the shared scorer starts with the 30 s default
    t0 = time.monotonic()
    with pytest.raises(EnvError, match=r"within timeout_s=0\.2s"):
        env_reward_func(env, timeout_s=0.2)(prompts=["x"], completions=["a"], task_id=[rows[0]["task_id"]])
    assert time.monotonic() - t0 < 2.0


def test_trl_funcs_need_task_ids() -> None:
    env = DigitReversalEnv(n_tasks=2)
    with pytest.raises(ValueError, match="task_id"):
        env_reward_func(env)(prompts=["1>"], completions=["1"])


# --- episodes -------------------------------------------------------------------------------


def test_multi_turn_episode_records_error_sites_at_feedback_turns() -> None:
    env = DigitReversalEnv(max_attempts=3)
    task = env.task("train:381")
    ep = run_episode(env, task, _replay(["381", "133", "183"]))
    assert ep.failed is None
    assert [s.done for s in ep.steps] == [False, False, True]
    assert [s.reward for s in ep.steps] == [0.0, 0.0, 1.0] and ep.reward == 1.0
    roles = [m.role for m in ep.episode.messages]
    assert roles == ["user", "assistant", "user", "assistant", "user", "assistant"]
    assert [m.text for m in ep.episode.messages] == ["381>", "381", "1.3|", "133", ".8.|", "183"]
    sites = episode_error_sites(ep)
    assert [(s.turn, s.action_turn) for s in sites] == [(2, 1), (4, 3)]
    assert [s.evidence for s in sites] == ["1.3|", ".8.|"] and sites[0].kinds == ("env_feedback",)

    records = episode_records(ep)
    assert [r.turn for r in records] == [1, 3]  # the correct last action has neither hint nor pair
    r0, r1 = records
    assert r1.prompt == [m.to_dict() for m in ep.episode.messages[:3]]
    assert r1.completion == [{"role": "assistant", "content": "133"}]
    assert r1.hint == ".8.|" and r1.teacher_prompt is not None and r1.hint_index == 3
    assert r1.teacher_prompt[r1.hint_index] == {"role": "user", "content": ".8.|"}
    assert r1.chosen == [{"role": "assistant", "content": "183"}] and r1.rejected == r1.completion
    assert r1.error_kinds == ["env_feedback"] and r0.hint == "1.3|"
    records_from_rows([r.to_dict() for r in records])  # the schema's own validation


def test_feedback_hint_sources() -> None:
    env = DigitReversalEnv(max_attempts=2)
    ep = run_episode(env, env.task("train:381"), _replay(["133", "000"]))
    site = episode_error_sites(ep)[0]
    assert feedback_hint()(ep.episode, site) == ".8.|"
    assert feedback_hint(ep)(ep.episode, site) == ".8.|"
    assert feedback_hint("try reversing")(ep.episode, site) == "try reversing"
    ctx = build_hinted_context(ep.episode, site, feedback_hint(ep))
    assert ctx.teacher_prompt == (*ep.episode.messages[:1], Message("user", ".8.|"))
    with pytest.raises(ValueError, match="empty"):
        feedback_hint("  ")


def test_reference_becomes_chosen_without_feedback() -> None:
    task = EnvTask("t1", "2+2=", reference="4")
    ep = episode_from_steps(task, ["5"], [StepResult(0.0, True)], env_name="arith")
    assert episode_error_sites(ep) == []
    (rec,) = episode_records(ep)
    assert rec.hint is None and rec.chosen == [{"role": "assistant", "content": "4"}]
    assert rec.rejected == [{"role": "assistant", "content": "5"}] and rec.chosen_teachers == ["env:arith"]
    assert episode_records(ep, pairs=False) == []


def test_chat_prompt_and_observation_turns() -> None:
    task = EnvTask("c", (Message("system", "be brief"), Message("user", "hi")), reference="ok")
    steps = [StepResult(0.5, False, feedback="too long", observation="obs 1"), StepResult(1.0, True)]
    ep = episode_from_steps(task, ["hello there", "ok"], steps, env_name="chat")
    assert [m.text for m in ep.episode.messages] == [
        "be brief",
        "hi",
        "hello there",
        "too long\n\nobs 1",
        "ok",
    ]
    assert ep.reward == 1.5  # the sum of the step rewards
    (site,) = episode_error_sites(ep)
    assert (site.turn, site.action_turn, site.evidence) == (3, 2, "too long")


class _Faulty:
    name = "faulty"

    def __init__(self, mode: str) -> None:
        self.mode = mode

    def tasks(self, split: str = "train", limit: int | None = None) -> Sequence[EnvTask]:
        return [EnvTask("t", "x")]

    def reset(self, task: EnvTask) -> _Faulty:
        if self.mode == "reset":
            raise EnvError("faulty: connection refused")
        return self

    def step(self, action: str) -> StepResult:
        if self.mode == "slow":
            time.sleep(5)
        if self.mode == "step":
            raise EnvError("faulty: garbage")
        return StepResult(0.0, False, feedback="again")

    def close(self) -> None:
        pass


@pytest.mark.parametrize(
    ("mode", "n_actions", "reason"),
    [("reset", 0, "connection refused"), ("step", 1, "garbage"), ("slow", 1, "within timeout_s=0.2s")],
)
def test_faults_become_failed_episodes(mode: str, n_actions: int, reason: str) -> None:
    env: Environment = _Faulty(mode)
    t0 = time.monotonic()
    ep = run_episode(env, EnvTask("t", "x"), lambda m: "a", max_turns=3, timeout_s=0.2)
    assert time.monotonic() - t0 < 2.0  # bounded by timeout_s, not by the 5 s sleep
    assert isinstance(ep, EnvEpisode) and ep.failed is not None and reason in ep.failed
    assert (
        "\n" not in ep.failed
        and ep.steps == ()
        and sum(m.role == "assistant" for m in ep.episode.messages) == n_actions
    )
    assert episode_records(ep) == []


def test_max_turns_bounds_an_endless_episode() -> None:
    ep = run_episode(_Faulty("ok"), EnvTask("t", "x"), lambda m: "a", max_turns=3)
    assert len(ep.steps) == 3 and ep.failed is None and len(episode_error_sites(ep)) == 3


def test_env_error_is_one_line() -> None:
    assert str(EnvError("server\n  down\tat x")) == "server down at x"


def test_contract_types_check_their_fields() -> None:
    with pytest.raises(TypeError, match="reward"):
        StepResult("1", True)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="NaN"):
        StepResult(float("nan"), True)
    with pytest.raises(ValueError, match="task_id"):
        EnvTask("", "x")
    with pytest.raises(ValueError, match="failed"):
        episode_from_steps(EnvTask("t", "x"), ["a"], [], env_name="e")


# --- registry -------------------------------------------------------------------------------


@pytest.mark.parametrize("spec", ["nope", "nope:x", "openenv:", "", "digit_reversal"])
def test_bad_spec_names_env_and_the_schemes(spec: str) -> None:
    with pytest.raises(ValueError) as e:
        load_env(spec)
    msg = str(e.value)
    assert msg.startswith("--env ") and "digit-reversal" in msg and "openenv" in msg and "verifiers" in msg
    assert "\n" not in msg


def test_openenv_scheme_names_the_extra_when_missing() -> None:
    if importlib.util.find_spec("openenv") is not None:
        pytest.skip("openenv is installed (tests/openenv covers the adapter)")
    with pytest.raises(ImportError, match=r"pip install 'composer-core\[openenv\]'"):
        load_env("openenv:http://127.0.0.1:1")


def test_load_env_passes_keywords() -> None:
    env = load_env("digit-reversal", n_tasks=5, max_attempts=2)
    assert isinstance(env, DigitReversalEnv) and env.max_attempts == 2 and len(env.tasks()) == 5
