"""Teacher replay against a real chat-completions HTTP server on 127.0.0.1 (composer_testkit.teacher_server).

No mocks: httpx talks to a real ThreadingHTTPServer; the resume test kills a real
``composer-replay`` subprocess with SIGKILL and counts requests on the server.
"""

import asyncio
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from composer_core.traces.records import read_records
from composer_core.traces.replay import ReplayCache, Replayer, ReplayJob, TeacherConfig, load_teachers
from composer_core.traces.schema import Episode, Message, ToolCall, write_openai_jsonl
from composer_testkit.teacher_server import ChatServer

FAST = {"backoff_base_s": 0.01, "backoff_max_s": 0.05}


def state(i: int = 0) -> tuple[Message, ...]:
    return (Message("system", "agent"), Message("user", f"task {i}"))


def teacher(srv: ChatServer, name: str = "a", model: str = "m1", **kw: object) -> TeacherConfig:
    return TeacherConfig(name, srv.base_url, model, **{**FAST, **kw})  # type: ignore[arg-type]


def test_answers_tokens_and_cost(tmp_path: Path) -> None:
    with ChatServer() as srv:
        t = teacher(srv, input_cost_per_mtok=2.0, output_cost_per_mtok=10.0)
        r = Replayer([t], tmp_path)
        (res,) = r.replay([ReplayJob("a", state())])
        assert res.ok and res.message.content.startswith("answer ") and not res.cached
        body = srv.bodies[0]
        assert body["model"] == "m1" and body["messages"][1] == {"role": "user", "content": "task 0"}
        assert body["temperature"] == 0.0 and body["max_tokens"] == 1024
        assert (res.prompt_tokens, res.completion_tokens) == (
            1 + len("agenttask 0") // 4,
            res.completion_tokens,
        )
        assert res.cost_usd == pytest.approx((res.prompt_tokens * 2.0 + res.completion_tokens * 10.0) / 1e6)
        st = r.stats["a"]
        assert (st.requests, st.answers, st.cache_hits, st.failures) == (1, 1, 0, 0)
        assert st.cost_usd == pytest.approx(res.cost_usd) and st.prompt_tokens == res.prompt_tokens


@pytest.mark.parametrize("fault", ["429", "500", "503", "timeout", "malformed", "no_choices"])
def test_transient_faults_are_retried(tmp_path: Path, fault: str) -> None:
    with ChatServer(faults={"m1": [fault, fault, "ok"]}, timeout_sleep_s=1.0) as srv:
        r = Replayer([teacher(srv, timeout_s=0.3, max_retries=2)], tmp_path)
        (res,) = r.replay([ReplayJob("a", state())])
        assert res.ok and res.attempts == 3
        assert (r.stats["a"].requests, r.stats["a"].retries, r.stats["a"].failures) == (3, 2, 0)
        assert srv.total_requests == 3


@pytest.mark.parametrize(
    ("fault", "reason"),
    [
        ("429", "http 429"),
        ("500", "http 500"),
        ("timeout", "timeout after 0.3s"),
        ("malformed", "malformed JSON"),
        ("no_choices", "no choices[0].message"),
    ],
)
def test_persistent_faults_become_recorded_failures(tmp_path: Path, fault: str, reason: str) -> None:
    with ChatServer(faults={"m2": [fault]}, repeat_last=True, timeout_sleep_s=1.0) as srv:
        good, bad = teacher(srv, "good", "m1"), teacher(srv, "bad", "m2", timeout_s=0.3, max_retries=2)
        r = Replayer([good, bad], tmp_path)
        res = r.replay([ReplayJob("good", state()), ReplayJob("bad", state())])
        assert res[0].ok
        assert not res[1].ok and res[1].message is None and res[1].attempts == 3
        assert reason in res[1].failure and "after 3 attempts" in res[1].failure
        assert r.stats["bad"].failures == 1 and r.stats["bad"].requests == 3
        assert srv.requests[("m2", next(k[1] for k in srv.requests if k[0] == "m2"))] == 3
        # failures are not cached: a rerun asks again (and succeeds once the endpoint is healthy)
        srv.faults.clear()
        r2 = Replayer([good, bad], tmp_path)
        res2 = r2.replay([ReplayJob("good", state()), ReplayJob("bad", state())])
        assert res2[0].cached and not res2[1].cached and res2[1].ok


def test_client_errors_are_not_retried(tmp_path: Path) -> None:
    with ChatServer(faults={"m1": ["400"]}, repeat_last=True) as srv:
        r = Replayer([teacher(srv, max_retries=3)], tmp_path)
        (res,) = r.replay([ReplayJob("a", state())])
        assert res.failure.startswith("http 400") and res.attempts == 1 and srv.total_requests == 1


def test_backoff_is_exponential_with_jitter_and_honours_retry_after(tmp_path: Path) -> None:
    slept: list[float] = []

    async def record_sleep(s: float) -> None:
        slept.append(s)

    with ChatServer(faults={"m1": ["500"]}, repeat_last=True) as srv:
        t = teacher(srv, max_retries=4, backoff_base_s=1.0, backoff_max_s=5.0)
        r = Replayer([t], None, sleep=record_sleep)
        r.replay([ReplayJob("a", state())])
    caps = [1.0, 2.0, 4.0, 5.0]
    assert len(slept) == 4
    assert all(c / 2 <= s <= c for s, c in zip(slept, caps)), slept
    assert len(set(slept)) == 4  # jittered, not a fixed schedule
    slept.clear()
    with ChatServer(faults={"m1": ["429", "ok"]}, retry_after="3") as srv:
        t = teacher(srv, backoff_base_s=0.1, backoff_max_s=10.0)
        Replayer([t], None, sleep=record_sleep).replay([ReplayJob("a", state())])
    assert slept and slept[0] >= 3.0


def test_concurrency_is_bounded(tmp_path: Path) -> None:
    with ChatServer(faults={"m1": ["timeout"]}, repeat_last=True, timeout_sleep_s=0.15) as srv:
        # "timeout" here just delays each answer by 0.15 s (below the client timeout)
        r = Replayer([teacher(srv, max_concurrency=3, timeout_s=5.0)], tmp_path, max_concurrency=8)
        t0 = time.perf_counter()
        res = r.replay([ReplayJob("a", state(i)) for i in range(9)])
        elapsed = time.perf_counter() - t0
    assert all(x.ok for x in res) and srv.max_in_flight == 3
    assert elapsed >= 3 * 0.15  # 9 requests, 3 at a time


def test_cache_never_pays_twice_and_dedupes_within_a_run(tmp_path: Path) -> None:
    with ChatServer() as srv:
        t = teacher(srv)
        jobs = [ReplayJob("a", state(0)), ReplayJob("a", state(0)), ReplayJob("a", state(1))]
        r = Replayer([t], tmp_path)
        first = r.replay(jobs)
        assert srv.total_requests == 2 and [x.cached for x in first] == [False, True, False]
        assert first[0].message == first[1].message
        r2 = Replayer([t], tmp_path)
        second = r2.replay(jobs)
        assert srv.total_requests == 2 and all(x.cached for x in second)
        assert [x.message for x in second] == [x.message for x in first]
        assert r2.stats["a"].cache_hits == 3 and r2.stats["a"].cost_usd == 0
        # the key covers teacher, model, state and sampling parameters
        k = ReplayCache.key(t, state(0))
        assert k != ReplayCache.key(TeacherConfig("b", t.base_url, "m1"), state(0))
        assert k != ReplayCache.key(TeacherConfig("a", t.base_url, "m9"), state(0))
        assert k != ReplayCache.key(TeacherConfig("a", t.base_url, "m1", temperature=1.0), state(0))
        assert k != ReplayCache.key(t, state(1))


def test_corrupt_cache_entry_is_an_error(tmp_path: Path) -> None:
    with ChatServer() as srv:
        t = teacher(srv)
        Replayer([t], tmp_path).replay([ReplayJob("a", state())])
        (entry,) = tmp_path.glob("a/*/*.json")
        entry.write_text("{trunc")
        with pytest.raises(ValueError, match="corrupt cache entry"):
            Replayer([t], tmp_path).replay([ReplayJob("a", state())])


def test_api_key_from_env_never_logged(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog) -> None:
    secret = "sk-test-5f2b8c1d9e-DO-NOT-LOG"
    monkeypatch.setenv("COMPOSER_TEST_KEY", secret)
    caplog.set_level(logging.DEBUG)
    with ChatServer(require_key=secret, faults={"m2": ["500", "500", "400"]}) as srv:
        good = teacher(srv, "good", "m1", api_key_env="COMPOSER_TEST_KEY")
        echo = teacher(srv, "echo", "m2", api_key_env="COMPOSER_TEST_KEY")
        r = Replayer([good, echo], tmp_path)
        res = r.replay([ReplayJob("good", state()), ReplayJob("echo", state())])
        assert srv.auth_headers and all(h == f"Bearer {secret}" for h in srv.auth_headers)
    assert res[0].ok
    assert res[1].failure.startswith("http 400") and "***" in res[1].failure  # the gateway echoed it
    everything = caplog.text + repr(res) + repr(r.summary()) + repr(good) + json.dumps(r.summary())
    everything += "".join(p.read_text() for p in tmp_path.rglob("*.json"))
    assert secret not in everything
    monkeypatch.delenv("COMPOSER_TEST_KEY")
    with pytest.raises(ValueError, match="COMPOSER_TEST_KEY is not set"):
        good.api_key()


def test_teachers_toml(tmp_path: Path) -> None:
    p = tmp_path / "t.toml"
    p.write_text(
        '[defaults]\ntimeout_s = 5\nmax_retries = 1\n\n[[teachers]]\nname = "a"\nbase_url = "http://127.0.0.1:1/v1"\n'
        'model = "m"\napi_key_env = "K"\ninput_cost_per_mtok = 3.0\n\n[[teachers]]\nname = "b"\n'
        'base_url = "http://127.0.0.1:1/v1"\nmodel = "m2"\nmax_retries = 7\nextra_body = {top_p = 0.9}\n'
    )
    a, b = load_teachers(p)
    assert (a.timeout_s, a.max_retries, a.api_key_env, a.input_cost_per_mtok) == (5, 1, "K", 3.0)
    assert (b.max_retries, dict(b.extra_body)) == (7, {"top_p": 0.9})
    bad = {
        'api_key = "sk-1"': "never put keys in files",
        "colour = 1": r"unknown keys \['colour'\]",
        "timeout_s = -1": "timeout_s must be a finite number >= 0",
        "max_concurrency = 0": "max_concurrency must be an integer >= 1",
    }
    for line, match in bad.items():
        p.write_text(f'[[teachers]]\nname = "a"\nbase_url = "http://x/v1"\nmodel = "m"\n{line}\n')
        with pytest.raises(ValueError, match=match):
            load_teachers(p)
    p.write_text('[[teachers]]\nname = "a"\nbase_url = "ftp://x"\nmodel = "m"\n')
    with pytest.raises(ValueError, match="http:// or https://"):
        load_teachers(p)


def test_unknown_teacher_in_job(tmp_path: Path) -> None:
    with ChatServer() as srv:
        r = Replayer([teacher(srv)], tmp_path)
        with pytest.raises(ValueError, match="unknown teacher 'zz'"):
            asyncio.run(r.areplay([ReplayJob("zz", state())]))


# --- the CLI, killed and resumed ----------------------------------------------------------------


def write_inputs(tmp_path: Path, srv: ChatServer, n_episodes: int) -> tuple[Path, Path]:
    eps = []
    for i in range(n_episodes):
        eps.append(
            Episode(
                f"ep{i}",
                (
                    Message("user", f"task {i}"),
                    Message(
                        "assistant", None, (ToolCall(f"c{i}", "bash", json.dumps({"cmd": f"pytest t{i}"})),)
                    ),
                    Message(
                        "tool", f"===== 1 failed in 0.1s =====\nexit code: 1 (run {i})", tool_call_id=f"c{i}"
                    ),
                    Message("assistant", f"I give up on {i}"),
                ),
            )
        )
    traces = tmp_path / "traces.jsonl"
    write_openai_jsonl(eps, traces)
    toml = tmp_path / "teachers.toml"
    toml.write_text(
        "[defaults]\nmax_concurrency = 1\nbackoff_base_s = 0.01\n\n"
        f'[[teachers]]\nname = "t1"\nbase_url = "{srv.base_url}"\nmodel = "m1"\ninput_cost_per_mtok = 1.0\n\n'
        f'[[teachers]]\nname = "t2"\nbase_url = "{srv.base_url}"\nmodel = "m2"\noutput_cost_per_mtok = 2.0\n'
    )
    return traces, toml


def cli(tmp_path: Path, traces: Path, toml: Path) -> list[str]:
    return [
        sys.executable, "-m", "composer_core.traces.replay_cli", "--traces", str(traces), "--teachers", str(toml),
        "--out", str(tmp_path / "pairs.jsonl"), "--max-concurrency", "1",
    ]  # fmt: skip


def run_cli_in_process(argv: list[str], capsys) -> tuple[int, str, str]:
    """The same ``main`` the console script runs, in this process (a subprocess re-imports torch)."""
    from composer_core.traces import replay_cli

    capsys.readouterr()
    rc = replay_cli.main(argv)
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_killed_replay_resumes_from_cache_without_duplicate_requests(tmp_path: Path, capsys) -> None:
    n_eps, kill_at = 5, 7  # 5 episodes x 2 student turns x 2 teachers = 20 requests
    proc: dict[str, subprocess.Popen] = {}

    def kill_on_nth(n: int, model: str, st: str) -> bool:
        if n == kill_at and "run" in proc:
            proc["run"].send_signal(signal.SIGKILL)
            proc["run"].wait()
            return True  # never answered
        return False

    with ChatServer(on_request=kill_on_nth) as srv:
        traces, toml = write_inputs(tmp_path, srv, n_eps)
        proc["run"] = subprocess.Popen(
            cli(tmp_path, traces, toml), stdout=subprocess.PIPE, stderr=subprocess.PIPE
        )
        proc["run"].wait(timeout=60)
        assert proc["run"].returncode == -signal.SIGKILL
        assert srv.total_requests == kill_at and sum(srv.answered.values()) == kill_at - 1
        assert len(list((tmp_path / "pairs.jsonl.cache").rglob("*.json"))) == kill_at - 1
        answered_before = set(srv.answered)
        del proc["run"]

        # the rerun: a fresh process would do the same; in-process keeps the test fast
        rc, stdout, stderr = run_cli_in_process(cli(tmp_path, traces, toml)[3:], capsys)
        assert rc == 0
        # every state was answered exactly once across both runs; nothing cached was asked again
        assert all(v == 1 for v in srv.answered.values()) and len(srv.answered) == 2 * n_eps * 2
        assert all(srv.requests[k] == 1 for k in answered_before)
        assert srv.total_requests == 2 * n_eps * 2 + 1  # + the one killed mid-flight
        summary = json.loads((tmp_path / "pairs.jsonl.summary.json").read_text())
        assert sum(t["cache_hits"] for t in summary["teachers"].values()) == kill_at - 1
        assert sum(t["requests"] for t in summary["teachers"].values()) == 2 * n_eps * 2 - (kill_at - 1)
        assert "teacher replay" in stderr and "100%" in stderr  # tqdm bar
        for col in ("requests", "cache_hits", "failures", "prompt_tokens", "completion_tokens", "cost_usd"):
            assert col in stdout

        records = read_records(tmp_path / "pairs.jsonl")
        # 2 teachers agree (deterministic server) -> a pair at every state; hints at the 5 faulty turns
        assert len(records) == 2 * n_eps and all(r.has_pair for r in records)
        assert sum(r.has_sdpo for r in records) == n_eps
        assert all(r.chosen_by == "majority" and r.chosen_teachers == ["t1", "t2"] for r in records)

        rc, _, _ = run_cli_in_process(cli(tmp_path, traces, toml)[3:], capsys)
        assert rc == 0 and srv.total_requests == 2 * n_eps * 2 + 1  # third run: all cached
        assert (tmp_path / "pairs.jsonl").read_text().splitlines() == [
            json.dumps(r.to_dict(), ensure_ascii=False) for r in records
        ]


def test_cli_records_failures_and_sdpo_without_teachers(tmp_path: Path, capsys) -> None:
    with ChatServer(faults={"m2": ["500"]}, repeat_last=True) as srv:
        traces, toml = write_inputs(tmp_path, srv, 2)
        toml.write_text(
            toml.read_text().replace("backoff_base_s = 0.01", "backoff_base_s = 0.01\nmax_retries = 1")
        )
        rc, _, _ = run_cli_in_process(
            [*cli(tmp_path, traces, toml)[3:], "--states", "errors", "--no-progress"], capsys
        )
        assert rc == 0
    fails = [json.loads(x) for x in (tmp_path / "pairs.jsonl.failures.jsonl").read_text().splitlines()]
    assert [(f["episode_id"], f["turn"], f["teacher"]) for f in fails] == [("ep0", 1, "t2"), ("ep1", 1, "t2")]
    assert all("http 500" in f["reason"] and "after 2 attempts" in f["reason"] for f in fails)
    records = read_records(tmp_path / "pairs.jsonl")
    assert [r.id for r in records] == ["ep0@1", "ep1@1"]
    # t1 answered alone: one answer out of one is a strict majority
    assert all(r.chosen_teachers == ["t1"] for r in records)
    summary = json.loads((tmp_path / "pairs.jsonl.summary.json").read_text())
    assert summary["teachers"]["t2"]["failures"] == 2 and summary["failed_requests"] == 2

    out2 = tmp_path / "sdpo.jsonl"
    rc, _, _ = run_cli_in_process(["--traces", str(traces), "--out", str(out2)], capsys)
    assert rc == 0
    recs = read_records(out2)
    assert len(recs) == 2 and all(r.has_sdpo and not r.has_pair for r in recs)


def test_console_script_installed() -> None:
    exe = shutil.which("composer-replay", path=str(Path(sys.executable).parent))
    if exe is None and os.environ.get("NOX_CURRENT_SESSION") is None:
        pytest.skip("not running from an installed environment")
    assert exe is not None
    out = subprocess.run([exe, "--help"], capture_output=True, text=True)
    assert out.returncode == 0 and "--teachers" in out.stdout and "--traces" in out.stdout


# --- hints from a teacher model, verifiers, in-process pipeline ---------------------------------


def hint_server_answer(model: str, messages: list[dict]) -> dict:
    if model == "hinter":
        assert messages[-1]["role"] == "user" and "hint" in messages[-1]["content"]
        assert messages[-2]["role"] == "tool"  # the hinter sees the failed tool result
        return {"role": "assistant", "content": "  Run only the failing test with -x first.  "}
    if model == "splitter":  # two teachers disagree with each other unless the verifier picks
        return {"role": "assistant", "content": f"option {len(messages)} {messages[-1].get('content')}"}
    return {"role": "assistant", "content": "answer from " + model}


def pipeline_episode(i: int = 0) -> Episode:
    return Episode(
        f"ep{i}",
        (
            Message("user", "fix"),
            Message("assistant", None, (ToolCall("c", "bash", '{"cmd": "pytest"}'),)),
            Message("tool", "===== 1 failed in 0.1s =====", tool_call_id="c"),
            Message("assistant", "done"),
        ),
    )


def test_teacher_model_hint_source(tmp_path: Path) -> None:
    from composer_core.traces.hints import TeacherHint, build_hinted_context
    from composer_core.traces.replay_cli import build_records
    from composer_core.traces.schema import find_error_sites

    with ChatServer(answer_fn=hint_server_answer, faults={"hinter": ["500", "ok"]}) as srv:
        r = Replayer([teacher(srv, "h", "hinter")], tmp_path)
        ep = pipeline_episode()
        hint_source = TeacherHint(r, "h")
        ctx = build_hinted_context(ep, find_error_sites(ep)[0], hint_source)
        assert ctx.hint == "Run only the failing test with -x first."
        assert ctx.teacher_prompt[ctx.hint_index] == Message("user", ctx.hint)
        assert srv.total_requests == 2  # one retry
        res = build_records([ep], None, hint_source=hint_source, progress=False)
        assert res.records[0].hint == ctx.hint and srv.total_requests == 2  # cached
        with pytest.raises(ValueError, match="teacher 'nobody' is not configured"):
            TeacherHint(r, "nobody")
    with ChatServer(faults={"hinter": ["500"]}, repeat_last=True) as srv:
        r = Replayer([teacher(srv, "h", "hinter", max_retries=1)], tmp_path / "other")
        with pytest.raises(RuntimeError, match=r"gave no hint.*http 500"):
            build_hinted_context(ep, find_error_sites(ep)[0], TeacherHint(r, "h"))


def test_build_records_verifier_filters_and_dedupe(tmp_path: Path) -> None:
    from composer_core.traces.replay_cli import build_records

    with ChatServer(answer_fn=hint_server_answer) as srv:
        teachers = [teacher(srv, "a", "m-a"), teacher(srv, "b", "m-b"), teacher(srv, "c", "m-c")]
        r = Replayer(teachers, tmp_path)
        eps = [pipeline_episode(0), pipeline_episode(1)]  # identical states: duplicates
        res = build_records(eps, r, progress=False)
        assert res.pairs == 0 and res.records == []  # three different answers: no strict majority
        accepted: list[str] = []

        def verifier(ep: Episode, turn: int, m: Message) -> bool:
            accepted.append(m.text)
            return m.text == "answer from m-b"

        res = build_records(eps, r, verifier=verifier, progress=False)
        # 2 states per episode; the duplicate episode's pairs are dropped
        assert res.pairs == 2 and res.dropped["duplicate"] == 2
        assert all(
            x.chosen_teachers == ["b"] and x.chosen_by == "verifier" for x in res.records if x.has_pair
        )
        assert {x.episode_id for x in res.records if x.has_pair} == {"ep0"}
        res = build_records(eps, r, verifier=verifier, max_chars=5, progress=False)
        assert res.pairs == 0 and res.dropped["too_long"] == 4
        from composer_core.traces.hints import error_text_hint

        res = build_records(
            eps, r, verifier=verifier, states="errors", hint_source=error_text_hint(), progress=False
        )
        assert [x.id for x in res.records] == ["ep0@1", "ep1@1"] and res.pairs == 1
        assert srv.total_requests == 3 * 2  # 3 teachers x 2 distinct states, everything else cached


def test_global_concurrency_and_extra_body(tmp_path: Path) -> None:
    with ChatServer(
        faults={"m1": ["timeout"], "m2": ["timeout"]}, repeat_last=True, timeout_sleep_s=0.15
    ) as srv:
        a = teacher(srv, "a", "m1", max_concurrency=4, timeout_s=5.0, extra_body={"top_p": 0.5, "seed": 7})
        b = teacher(srv, "b", "m2", max_concurrency=4, timeout_s=5.0, temperature=None, max_tokens=None)
        r = Replayer([a, b], tmp_path, max_concurrency=2)
        res = r.replay([ReplayJob(name, state(i)) for i in range(4) for name in ("a", "b")])
        assert all(x.ok for x in res) and srv.max_in_flight == 2
        by_model = {body["model"]: body for body in srv.bodies}
        assert by_model["m1"]["top_p"] == 0.5 and by_model["m1"]["seed"] == 7
        assert "temperature" not in by_model["m2"] and "max_tokens" not in by_model["m2"]


def test_cli_flags_in_process(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    from composer_core.traces import replay_cli

    session = [
        {"type": "user", "sessionId": "s1", "message": {"role": "user", "content": "fix"}},
        {
            "type": "assistant",
            "sessionId": "s1",
            "message": {
                "id": "m1",
                "role": "assistant",
                "content": [{"type": "tool_use", "id": "t1", "name": "Bash", "input": {"command": "make"}}],
            },
        },
        {
            "type": "user",
            "sessionId": "s1",
            "message": {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": "t1", "is_error": True, "content": "boom"}
                ],
            },
        },
    ]
    traces = tmp_path / "claude.jsonl"
    traces.write_text("\n".join(json.dumps(x) for x in session) + "\n")
    (tmp_path / "my_verifier.py").write_text(
        "def accept(episode, turn, message):\n    return message.text.startswith('answer')\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    with ChatServer() as srv:
        _, toml = write_inputs(tmp_path, srv, 1)
        paths = {k: tmp_path / "elsewhere" / k for k in ("cache", "fails.jsonl", "sum.json")}
        paths["cache"].parent.mkdir()
        argv = [
            "--traces", str(traces), "--format", "claude-code", "--teachers", str(toml),
            "--out", str(tmp_path / "o.jsonl"), "--cache-dir", str(paths["cache"]),
            "--failures", str(paths["fails.jsonl"]), "--summary", str(paths["sum.json"]),
            "--hint", "template", "--hint-template", "Tool {tool_name} said: {error}",
            "--verifier", "my_verifier:accept", "--no-progress",
        ]  # fmt: skip
        assert replay_cli.main(argv) == 0
        (rec,) = read_records(tmp_path / "o.jsonl")
        assert rec.hint == "Tool Bash said: boom" and rec.chosen_by == "verifier"
        assert rec.chosen_teachers == ["t1", "t2"]
        assert list(paths["cache"].rglob("*.json")) and paths["fails.jsonl"].read_text() == ""
        assert json.loads(paths["sum.json"].read_text())["pairs"] == 1
        assert replay_cli.main([*argv, "--plot", str(tmp_path / "summary.png")]) == 0
        assert (tmp_path / "summary.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert "cache_hits" in capsys.readouterr().out
        with pytest.raises(SystemExit, match="needs --hint-template"):
            replay_cli.main([*argv[:-7], "--hint", "template"])
        with pytest.raises(SystemExit, match="module:function"):
            replay_cli.main([*argv[:-3], "--verifier", "nocolon"])
        with pytest.raises(ValueError, match="unsupported user content block"):
            bad = tmp_path / "bad.jsonl"
            bad.write_text(
                json.dumps({**session[0], "message": {"role": "user", "content": [{"type": "x"}]}})
            )
            replay_cli.main(["--traces", str(bad), "--out", str(tmp_path / "b.jsonl")])


def test_unusable_answer_is_a_recorded_failure(tmp_path: Path) -> None:
    with ChatServer(answer_fn=lambda model, messages: {"role": "assistant", "content": None}) as srv:
        r = Replayer([teacher(srv)], tmp_path)
        (res,) = r.replay([ReplayJob("a", state())])
        assert (
            not res.ok and "unusable answer" in res.failure and "needs content or tool_calls" in res.failure
        )
        assert r.stats["a"].failures == 1 and r.stats["a"].answers == 1
        (again,) = Replayer([teacher(srv)], tmp_path).replay([ReplayJob("a", state())])
        assert again.cached and not again.ok and srv.total_requests == 1  # paid once, not re-asked


def test_cli_length_and_dedupe_flags(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """--min-chars / --max-chars / --no-dedupe reach filter_pairs (counts in the summary JSON)."""
    from composer_core.traces import replay_cli

    traces = tmp_path / "traces.jsonl"
    write_openai_jsonl([pipeline_episode(0), pipeline_episode(1)], traces)  # identical states: duplicates
    (tmp_path / "pick_b.py").write_text(
        "def accept(episode, turn, message):\n    return message.text == 'answer from m-b'\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    with ChatServer(answer_fn=hint_server_answer) as srv:
        toml = tmp_path / "teachers.toml"
        toml.write_text(
            "[defaults]\nbackoff_base_s = 0.01\n"
            + "".join(
                f'[[teachers]]\nname = "{n}"\nbase_url = "{srv.base_url}"\nmodel = "m-{n}"\n' for n in "abc"
            )
        )

        def run(*flags: str) -> dict:
            out = tmp_path / "o.jsonl"
            argv = ["--traces", str(traces), "--teachers", str(toml), "--out", str(out)]
            assert replay_cli.main([*argv, "--verifier", "pick_b:accept", "--no-progress", *flags]) == 0
            return json.loads((tmp_path / "o.jsonl.summary.json").read_text())

        default = run()
        assert default["pairs"] == 2 and default["dropped"]["duplicate"] == 2
        no_dedupe = run("--no-dedupe")
        assert no_dedupe["pairs"] == 4 and no_dedupe["dropped"]["duplicate"] == 0
        too_long = run("--max-chars", "5")
        assert too_long["pairs"] == 0 and too_long["dropped"]["too_long"] == 4
        too_short = run("--min-chars", "1000")
        assert too_short["pairs"] == 0 and too_short["dropped"]["too_short"] == 4
        assert srv.total_requests == 3 * 2  # every rerun answered from the cache
        with pytest.raises(ValueError, match="min_chars"):
            run("--min-chars", "10", "--max-chars", "5")
