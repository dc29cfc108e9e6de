"""composer_core.envs.openenv against a real OpenEnv server process serving the digit-reversal task.

The server is ``python -m composer_core.envs.openenv_digit_reversal`` (OpenEnv's own HTTPEnvServer); the
adapter talks to it through OpenEnv's own GenericEnvClient. Faults: server down, slow, garbage, wrong schema.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import pytest
from composer_core.envs import (
    DigitReversalEnv,
    EnvError,
    env_dataset_rows,
    env_hint_func,
    env_reward_func,
    episode_error_sites,
    episode_records,
    load_env,
    run_episode,
)
from composer_core.envs.openenv import OpenEnvEnvironment, redact_url
from composer_core.tasks.digit_reversal import feedback_hint, verify
from composer_testkit.env_server import free_port


def _replay(actions: Sequence[str]):
    it = iter(actions)
    return lambda messages: next(it)


def test_tasks_come_from_openenv_task_api(servers: dict[str, str]) -> None:
    env = load_env(f"openenv:{servers['ok']}", timeout_s=30)
    assert isinstance(env, OpenEnvEnvironment) and env.env_name == "digit_reversal"
    assert env.action_field == "answer"  # discovered from the server's /schema
    remote = env.tasks("train", limit=5)
    local = DigitReversalEnv(n_tasks=16).tasks("train", limit=5)
    assert [t.task_id for t in remote] == [t.task_id for t in local]
    assert [(t.prompt, t.reference, t.info["rejected"]) for t in remote] == [
        (t.prompt, t.reference, t.info["rejected"]) for t in local
    ]


def test_rewards_and_hints_through_the_server_are_the_task_rules(servers: dict[str, str]) -> None:
    env = load_env(f"openenv:{servers['ok']}", timeout_s=30)
    rows = env_dataset_rows(env, "train", 4)
    prompts, ids = [r["prompt"] for r in rows], [r["task_id"] for r in rows]
    completions = [rows[0]["chosen"], rows[1]["rejected"], "1", rows[3]["chosen"] + "0"]
    rewards = env_reward_func(env)(prompts=prompts, completions=completions, task_id=ids)
    hints = env_hint_func(env)(prompts=prompts, completions=completions, task_id=ids)
    assert rewards == [verify(p, c) for p, c in zip(prompts, completions)]
    assert rewards[0] == 1.0 and rewards[3] == pytest.approx(3 / 4)
    assert hints == [feedback_hint(p, c) for p, c in zip(prompts, completions)]
    assert hints[0] is None and hints[1] is not None and hints[1].endswith("|")


def test_multi_turn_episode_through_the_server(servers: dict[str, str]) -> None:
    env = OpenEnvEnvironment(servers["ok"], timeout_s=30, reset_kwargs={"max_attempts": 3})
    task = env.tasks("train", limit=1)[0]
    ref = task.reference
    assert ref is not None and len(ref) == 3
    wrong1, wrong2 = ref[::-1] if ref != ref[::-1] else "000", ref[:2] + str((int(ref[2]) + 1) % 10)
    ep = run_episode(env, task, _replay([wrong1, wrong2, ref]), timeout_s=30)
    assert ep.failed is None and [s.done for s in ep.steps] == [False, False, True]
    assert [s.reward for s in ep.steps] == [0.0, 0.0, 1.0]
    local = run_episode(DigitReversalEnv(max_attempts=3), task, _replay([wrong1, wrong2, ref]))
    assert [m.to_dict() for m in ep.episode.messages] == [m.to_dict() for m in local.episode.messages]
    sites = episode_error_sites(ep)
    assert [(s.turn, s.action_turn) for s in sites] == [(2, 1), (4, 3)]
    assert [s.evidence for s in sites] == [feedback_hint(str(task.prompt), a) for a in (wrong1, wrong2)]
    records = episode_records(ep)
    assert [r.turn for r in records] == [1, 3] and all(
        r.chosen == [{"role": "assistant", "content": ref}] for r in records
    )


def _assert_one_line(msg: str, *needles: str) -> None:
    assert "\n" not in msg and len(msg) <= 300, msg
    for n in needles:
        assert n in msg, msg


def test_server_down_is_a_clear_error_and_a_failed_episode() -> None:
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    env = OpenEnvEnvironment(url, timeout_s=5)
    t0 = time.monotonic()
    with pytest.raises(EnvError) as e:
        env.tasks("train")
    _assert_one_line(str(e.value), "cannot connect", "is the OpenEnv server running?", url)
    task = DigitReversalEnv().task("train:381")
    ep = run_episode(env, task, _replay(["183"]), timeout_s=5)
    assert ep.failed is not None and ep.steps == ()
    _assert_one_line(ep.failed, "cannot connect")
    assert time.monotonic() - t0 < 30


def test_slow_server_times_out_within_the_bound(servers: dict[str, str]) -> None:
    env = OpenEnvEnvironment(servers["slow"], timeout_s=3)
    task = env.tasks("train", limit=1)[0]  # the Task API and reset stay fast; every step sleeps 60 s
    t0 = time.monotonic()
    ep = run_episode(env, task, _replay(["123"]), timeout_s=3)
    assert time.monotonic() - t0 < 20, "the step was not bounded by timeout_s"
    assert (
        ep.failed is not None
        and ep.steps == ()
        and [m.text for m in ep.episode.messages if m.role == "assistant"] == ["123"]
    )
    _assert_one_line(ep.failed, "did not answer within timeout_s=3s")
    rows = env_dataset_rows(env, "train", 1)
    t0 = time.monotonic()
    with pytest.raises(EnvError, match="did not answer within"):
        env_reward_func(env, timeout_s=3)(
            prompts=[rows[0]["prompt"]], completions=["1"], task_id=[rows[0]["task_id"]]
        )
    assert time.monotonic() - t0 < 20


@pytest.mark.parametrize(("mode", "needle"), [("garbage", "non-JSON"), ("schema", "malformed observation")])
def test_garbage_answers_are_clear_errors(servers: dict[str, str], mode: str, needle: str) -> None:
    env = OpenEnvEnvironment(servers[mode], timeout_s=5)
    task = env.tasks("train", limit=1)[0]
    ep = run_episode(env, task, _replay(["123"]), timeout_s=5)
    assert ep.failed is not None and ep.steps == ()
    _assert_one_line(ep.failed, needle, "reset")
    with pytest.raises(EnvError, match=needle):
        env.reset(task)


def test_wrong_shape_step_results_are_rejected() -> None:
    from openenv.core.client_types import StepResult as OEStep

    env = OpenEnvEnvironment("http://127.0.0.1:1", timeout_s=1)
    assert env.parse(OEStep({"feedback": "x"}, 0.5, False), "step").feedback == "x"
    for bad, needle in [
        (OEStep("oops", 1.0, True), "malformed observation"),
        (OEStep({}, "high", True), "malformed reward"),
        (OEStep({}, 1.0, "maybe"), "malformed done"),  # type: ignore[arg-type]
        (OEStep({"feedback": 3}, 1.0, True), "malformed 'feedback'"),
    ]:
        with pytest.raises(EnvError, match=needle):
            env.parse(bad, "step")


def test_bad_urls_and_redaction() -> None:
    with pytest.raises(ValueError, match="--env openenv:"):
        load_env("openenv:localhost:8000")
    assert redact_url("http://user:secret@host:8000/x") == "http://***@host:8000/x"
    env = OpenEnvEnvironment("http://user:secret@127.0.0.1:1", timeout_s=2)
    with pytest.raises(EnvError) as e:
        env.tasks()
    assert "secret" not in str(e.value) and "***@127.0.0.1:1" in str(e.value)
