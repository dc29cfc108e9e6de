"""composer-replay against hostile teacher endpoints (issue 15 item 1).

A real ThreadingHTTPServer on 127.0.0.1 (composer_testkit.teacher_server) with fault
modes, and the real ``composer-replay`` CLI as a subprocess wherever the property concerns the
process (its output files, stdout/stderr, exit status, peak RSS, SIGKILL).
"""

import base64
import json
import logging
import os
import signal
import subprocess
import sys
import time
import urllib.parse
from pathlib import Path
from typing import Any

import pytest
from composer_core.traces.records import read_records
from composer_core.traces.replay import ReplayCache, Replayer, ReplayJob, TeacherConfig, redact
from composer_core.traces.schema import Episode, Message, ToolCall, write_openai_jsonl
from composer_testkit.teacher_server import BAD_PAYLOADS, ChatServer

# URL-encoding changes '/', '+' and '=', so the encoded form differs from the raw key
SECRET = "sk-Zq7/Xw+Lm9=Rt4Pv2Ks8Nd6Hy3Jb5Wc1"
KEY_ENV = "COMPOSER_FAULT_TEST_KEY"
FAST = {"backoff_base_s": 0.01, "backoff_max_s": 0.02}
# composer-replay, SIGKILLed between writing the 3rd cache entry's temporary file and renaming it
KILLED_AT_3RD_CACHE_WRITE = """
import os, signal, sys
from composer_core.traces import replay_cli
real_replace, renames = os.replace, []
def replace(src, dst):
    renames.append(dst)
    if len(renames) == 3:
        os.kill(os.getpid(), signal.SIGKILL)
    real_replace(src, dst)
os.replace = replace
sys.exit(replay_cli.main(sys.argv[1:]))
"""


def leaked_forms(secret: str = SECRET) -> list[str]:
    """Every 8-character run of the key plus its whole URL-encoded and base64 forms."""
    subs = [secret[i : i + 8] for i in range(len(secret) - 7)]
    b64 = [base64.b64encode(x.encode()).decode().rstrip("=") for x in (secret, f"Bearer {secret}")]
    return [*subs, urllib.parse.quote(secret, safe=""), *b64]


def assert_no_leak(text: str, where: str) -> None:
    found = [f for f in leaked_forms() if f in text]
    assert not found, f"{where} leaks {found[:3]}"


def episodes(n: int) -> list[Episode]:
    return [
        Episode(
            f"ep{i}",
            (
                Message("user", f"task {i}"),
                Message("assistant", None, (ToolCall(f"c{i}", "bash", json.dumps({"cmd": f"make {i}"})),)),
                Message("tool", f"===== 1 failed =====\nexit code: 1 ({i})", tool_call_id=f"c{i}"),
                Message("assistant", f"stuck {i}"),
            ),
        )
        for i in range(n)
    ]


def write_run(tmp_path: Path, teachers: list[dict[str, Any]], n_eps: int = 1) -> tuple[Path, Path]:
    traces = tmp_path / "traces.jsonl"
    write_openai_jsonl(episodes(n_eps), traces)
    lines = ["[defaults]", "max_concurrency = 2", "backoff_base_s = 0.01", "backoff_max_s = 0.02", ""]
    for t in teachers:
        lines.append("[[teachers]]")
        lines += [f"{k} = {json.dumps(v)}" for k, v in t.items()]
        lines.append("")
    toml = tmp_path / "teachers.toml"
    toml.write_text("\n".join(lines))
    return traces, toml


def cli_argv(tmp_path: Path, traces: Path, toml: Path, *flags: str) -> list[str]:
    out = tmp_path / "out" / "pairs.jsonl"
    out.parent.mkdir(exist_ok=True)
    return [
        sys.executable, "-m", "composer_core.traces.replay_cli", "--traces", str(traces),
        "--teachers", str(toml), "--out", str(out), *flags,
    ]  # fmt: skip


def run_cli(argv: list[str], env: dict[str, str] | None = None, timeout: float = 240) -> tuple[int, str, str]:
    """Run the CLI as a real process: (exit status, stdout, stderr)."""
    proc = subprocess.run(
        argv, env={**os.environ, **(env or {})}, capture_output=True, text=True, timeout=timeout
    )
    return proc.returncode, proc.stdout, proc.stderr


def run_cli_rss(argv: list[str], timeout: float = 240) -> tuple[int, str, int]:
    """Run the CLI as a real process, reaped with ``os.wait4`` to read *its own* peak RSS (KiB)."""
    log_path = Path(argv[argv.index("--out") + 1]).with_suffix(".log")
    with open(log_path, "w") as log, open(os.devnull) as null:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=null)
        for _ in range(int(timeout * 10)):  # bounded wait
            pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
            if pid:
                break
            time.sleep(0.1)
        else:
            proc.kill()
            proc.wait()
            raise AssertionError("composer-replay did not finish")
    proc.returncode = os.waitstatus_to_exitcode(status)
    return proc.returncode, log_path.read_text(), usage.ru_maxrss


# --- secrets ------------------------------------------------------------------------------------


def test_redact_catches_cut_prefixes_suffixes_and_encoded_forms() -> None:
    key = SECRET
    for text in (
        key[:23],  # a key cut at a truncation edge (the 23 of 28 characters)
        key[-9:],
        "Authorization: Bearer " + key,
        urllib.parse.quote(key, safe=""),
        json.dumps({"k": key}),
        *(base64.b64encode(p.encode() + key.encode()).decode() for p in ("", "Bearer ", "u:", "x")),
        *(base64.urlsafe_b64encode(p.encode() + key.encode()).decode() for p in ("", ":", "ab")),
    ):
        red = redact(f"<{text}>", [key])
        assert "***" in red, text
        assert_no_leak(red, f"redact({text!r})")
    assert redact("nothing secret here at all", [key]) == "nothing secret here at all"
    spam = (key * 3 + " ") * 50_000  # 5 MB of keys: dropped whole, quickly, not scanned per copy
    assert redact(spam, [key]) == "*** (redacted whole: it holds too many copies of an API key)"
    assert redact(f"pre{key}{key[:10]}post", [key]) == "pre***post"
    assert redact("a short key abc12", ["abc12"]) == "a short key ***"


def test_secret_never_leaks_on_any_error_path(tmp_path: Path) -> None:
    """401 with the key at the 300-char edge, 500, garbage JSON at the 80-char edge, timeout,
    oversize, connection refused, and an answer that echoes the key: nothing reaches a file or log."""
    prefix_401 = len('{"error": {"message": "') + len("Authorization: Bearer ")
    pads = {
        "m401": 300 - prefix_401 - len(SECRET) // 2,  # the key straddles the 300-character cut
        "mjunk": 80 - len("<html>Authorization: Bearer ") - len(SECRET) // 2,  # ... the 80-character cut
    }
    faults = {
        "m401": ["401"],
        "m500": ["500_echo"],
        "mjunk": ["malformed_echo"],
        "mslow": ["timeout"],
        "mbig": ["oversize"],
        "mecho": ["answer_echo"],
    }
    with ChatServer(
        faults=faults, repeat_last=True, echo_pad=pads, timeout_sleep_s=1.0, oversize_bytes=3 * 2**20
    ) as srv:
        teachers = [
            {"name": m[1:], "base_url": srv.base_url, "model": m, "api_key_env": KEY_ENV, "max_retries": 1}
            for m in faults
        ]
        teachers[3]["timeout_s"] = 0.3
        teachers.append({"name": "ok", "base_url": srv.base_url, "model": "mok", "api_key_env": KEY_ENV})
        teachers.append(  # nothing listens there: connection refused
            {"name": "down", "base_url": "http://127.0.0.1:9/v1", "model": "m", "api_key_env": KEY_ENV}
        )
        traces, toml = write_run(tmp_path, teachers)
        argv = cli_argv(tmp_path, traces, toml, "--max-response-bytes", str(2**20))
        rc, out, err = run_cli(argv, {KEY_ENV: SECRET})
        assert srv.auth_headers and all(h == f"Bearer {SECRET}" for h in srv.auth_headers)
    # 8 teachers x 2 states; 401/500/junk/slow/big/down fail = 12 of 16 (> 0.5): exit 4
    assert rc == 4, err
    assert_no_leak(out + err, "stdout/stderr")
    files = [p for p in (tmp_path / "out").rglob("*") if p.is_file()]
    assert any(".cache" in str(p) for p in files) and len(files) >= 5
    for p in files:
        assert_no_leak(p.read_text(errors="replace"), str(p))
    fails = {
        json.loads(x)["teacher"]: json.loads(x)["reason"]
        for x in (tmp_path / "out" / "pairs.jsonl.failures.jsonl").read_text().splitlines()
    }
    assert set(fails) == {"401", "500", "junk", "slow", "big", "down"}
    # the echo did arrive (and was redacted, not dropped): padding, header name, ***
    assert fails["401"].startswith("http 401: ") and "xxxxAuthorization: Bearer ***" in fails["401"]
    assert "Authorization: Bearer ***" in fails["junk"] and "malformed JSON" in fails["junk"]
    assert "timeout after 0.3s" in fails["slow"] and "connection error" in fails["down"]
    assert "response larger than max_response_bytes=1048576" in fails["big"]
    cache_echo = [p.read_text() for p in (tmp_path / "out" / "pairs.jsonl.cache" / "echo").rglob("*.json")]
    assert len(cache_echo) == 2 and all("ok Authorization: Bearer ***" in c for c in cache_echo)


def test_secret_absent_from_exceptions_logs_and_results(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from composer_core.traces.hints import TeacherHint, build_hinted_context
    from composer_core.traces.schema import find_error_sites

    monkeypatch.setenv(KEY_ENV, SECRET)
    caplog.set_level(logging.DEBUG)
    pad = 300 - len('{"error": {"message": "Authorization: Bearer ') - 10
    with ChatServer(faults={"m": ["401"]}, repeat_last=True, echo_pad=pad) as srv:
        t = TeacherConfig("h", srv.base_url, "m", api_key_env=KEY_ENV, **FAST)  # type: ignore[arg-type]
        r = Replayer([t], tmp_path)
        ep = episodes(1)[0]
        with pytest.raises(RuntimeError, match="gave no hint") as exc:
            build_hinted_context(ep, find_error_sites(ep)[0], TeacherHint(r, "h"))
    assert "http 401" in str(exc.value) and "***" in str(exc.value)
    assert_no_leak(str(exc.value) + repr(exc.value.__cause__), "exception")
    assert_no_leak(caplog.text + json.dumps(r.summary()), "log / summary")


# --- malformed responses ------------------------------------------------------------------------

UNKNOWN_USAGE = ["usage_str", "usage_inf", "usage_missing", "usage_not_dict", "usage_negative", "usage_huge"]
MALFORMED = ["choices_empty", "choices_not_list", "choice_not_dict", "message_not_dict", "not_object"]
# issue 62: a role other than "assistant" (7, "system") was overwritten with "assistant" and counted as good
UNUSABLE = ["content_not_str", "tool_calls_not_list", "role_wrong", "role_system"]


def test_fault_lists_cover_every_bad_payload() -> None:
    assert set(UNKNOWN_USAGE + MALFORMED + UNUSABLE) == set(BAD_PAYLOADS)


@pytest.mark.parametrize("fault", UNKNOWN_USAGE + MALFORMED + UNUSABLE)
def test_malformed_response_fails_that_request_only(tmp_path: Path, fault: str) -> None:
    with ChatServer(faults={"bad": [fault]}, repeat_last=True) as srv:
        good = TeacherConfig("good", srv.base_url, "m", input_cost_per_mtok=1.0, **FAST)  # type: ignore[arg-type]
        bad = TeacherConfig("bad", srv.base_url, "bad", max_retries=1, input_cost_per_mtok=1.0, **FAST)  # type: ignore[arg-type]
        r = Replayer([good, bad], tmp_path)
        jobs = [ReplayJob(n, (Message("user", f"q{i}"),)) for i in range(2) for n in ("good", "bad")]
        res = r.replay(jobs)
    assert all(x.ok for x in res[::2])  # the other teacher is unaffected
    st = r.stats["bad"]
    if fault in UNKNOWN_USAGE:  # the answer is fine; its accounting is unknown, not a crash, not a guess
        assert all(x.ok for x in res[1::2])
        assert st.usage_unknown == 2 and st.failures == 0 and r.stats["good"].usage_unknown == 0
        assert all(x.cost_usd is None for x in res[1::2])
        assert any(x.prompt_tokens is None or x.completion_tokens is None for x in res[1::2])
    elif fault in MALFORMED:  # retried, then a recorded failure with its reason (not cached)
        assert all(
            not x.ok and "malformed response" in x.failure and "after 2 attempts" in x.failure
            for x in res[1::2]
        )
        assert st.failures == 2 and st.requests == 4
    else:  # paid for, unusable: a cached failure naming the field
        assert all(not x.ok and x.failure.startswith("unusable answer") for x in res[1::2])
        assert st.failures == 2 and st.answers == 2
        if fault.startswith("role"):
            assert all("role" in x.failure for x in res[1::2]), res[1].failure
            again = Replayer([good, bad], tmp_path).replay(jobs)  # re-read from the cache: still refused
            assert [x.ok for x in again] == [True, False] * 2 and all(x.cached for x in again)


def test_cli_survives_bad_usage_and_caches_it(tmp_path: Path) -> None:
    """The issue's run: prompt_tokens "abc" / 1e999 used to exit 1 with no outputs and no cache."""
    with ChatServer(faults={"mstr": ["usage_str"], "minf": ["usage_inf"]}, repeat_last=True) as srv:
        teachers = [
            {"name": n, "base_url": srv.base_url, "model": m, "input_cost_per_mtok": 1.0}
            for n, m in (("s", "mstr"), ("i", "minf"), ("g", "mgood"))
        ]
        traces, toml = write_run(tmp_path, teachers, n_eps=2)
        argv = cli_argv(tmp_path, traces, toml, "--no-progress")
        rc, out, err = run_cli(argv)
        assert rc == 0, err
        first = json.loads((tmp_path / "out" / "pairs.jsonl.summary.json").read_text())
        n_requests = srv.total_requests
        rc2, _, err2 = run_cli(argv)  # rerun: every answer comes from the cache
        assert rc2 == 0 and srv.total_requests == n_requests == 3 * 4, err2
    assert first["failed_requests"] == 0 and "usage_unknown" in out
    unknown = {n: t["usage_unknown"] for n, t in first["teachers"].items()}
    assert unknown == {"s": 4, "i": 4, "g": 0}
    assert first["teachers"]["g"]["prompt_tokens"] > 0 and first["teachers"]["i"]["prompt_tokens"] == 0
    second = json.loads((tmp_path / "out" / "pairs.jsonl.summary.json").read_text())
    assert second["teachers"]["s"]["cache_hits"] == 4
    assert len(read_records(tmp_path / "out" / "pairs.jsonl")) == 4
    cached = [
        json.loads(p.read_text()) for p in (tmp_path / "out" / "pairs.jsonl.cache" / "i").rglob("*.json")
    ]
    assert len(cached) == 4 and all(c["usage"]["prompt_tokens"] is None for c in cached)


# --- unbounded responses ------------------------------------------------------------------------


def test_oversize_response_is_refused_streamed_with_bounded_rss(tmp_path: Path) -> None:
    """60 MB bodies (declared length and chunked) against the default 8 MiB cap: the process's
    own peak RSS stays within 40 MiB of a run with small answers, and the server could not send
    the body whole."""
    big = 60_000_000
    with ChatServer(
        faults={"mlen": ["oversize"], "mchunk": ["oversize_chunked"]}, repeat_last=True, oversize_bytes=big
    ) as srv:
        base = [{"name": "g", "base_url": srv.base_url, "model": "mgood"}]
        (tmp_path / "base").mkdir()
        traces, toml = write_run(tmp_path / "base", base)
        rc, log0, rss_base = run_cli_rss(cli_argv(tmp_path / "base", traces, toml, "--no-progress"))
        assert rc == 0, log0
        teachers = [
            {"name": "len", "base_url": srv.base_url, "model": "mlen", "max_retries": 3},
            {"name": "chunk", "base_url": srv.base_url, "model": "mchunk", "max_retries": 3},
            *base,
        ]
        traces, toml = write_run(tmp_path, teachers)
        rc, log1, rss_big = run_cli_rss(cli_argv(tmp_path, traces, toml, "--no-progress"))
        sent = srv.oversize_sent
        requests = srv.total_requests
    assert rc == 4, log1  # 4 of 6 requests failed
    fails = [
        json.loads(x) for x in (tmp_path / "out" / "pairs.jsonl.failures.jsonl").read_text().splitlines()
    ]
    assert len(fails) == 4 and all(
        f"response larger than max_response_bytes={8 * 2**20}" in f["reason"]
        and "after 1 attempt)" in f["reason"]
        for f in fails
    )  # refused, not retried: a deterministic oversize answer would be paid for again
    assert requests == 2 + 6  # base run + this run, no retries
    assert sent < 4 * big / 2, sent  # four 60 MB bodies were offered; far less was ever written
    grew_mib = (rss_big - rss_base) / 1024
    print(f"peak RSS {rss_base / 1024:.0f} -> {rss_big / 1024:.0f} MiB; {sent} of {4 * big} bytes sent")
    assert grew_mib < 40, (rss_base, rss_big)


# --- exit status --------------------------------------------------------------------------------


def test_exit_status_all_failed_and_failure_rate(tmp_path: Path) -> None:
    from composer_core.traces import replay_cli

    with ChatServer(faults={"m1": ["500"]}, repeat_last=True) as srv:
        one = [{"name": "a", "base_url": srv.base_url, "model": "m1", "max_retries": 0}]
        traces, toml = write_run(tmp_path, one, n_eps=2)
        rc, _, err = run_cli(cli_argv(tmp_path, traces, toml, "--no-progress"))
        assert rc == 3 and "all 4 teacher requests failed" in err, err
        assert (tmp_path / "out" / "pairs.jsonl.summary.json").is_file()  # outputs written anyway
        fails = (tmp_path / "out" / "pairs.jsonl.failures.jsonl").read_text().splitlines()
        assert len(fails) == 4
        two = [*one, {"name": "b", "base_url": srv.base_url, "model": "m2"}]
        traces, toml = write_run(tmp_path, two, n_eps=2)
        argv = cli_argv(tmp_path, traces, toml, "--no-progress")[3:]
        assert replay_cli.main(argv) == 0  # 4 of 8 failed: 0.5 is not above the default 0.5
        assert replay_cli.main([*argv, "--max-failure-rate", "0.25"]) == replay_cli.EXIT_TOO_MANY_FAILED == 4
        assert replay_cli.main([*argv, "--max-failure-rate", "1"]) == 0
        with pytest.raises(SystemExit) as e:
            replay_cli.main([*argv, "--max-failure-rate", "1.5"])
        assert e.value.code == 2
    help_text = subprocess.run(
        [sys.executable, "-m", "composer_core.traces.replay_cli", "--help"], capture_output=True, text=True
    ).stdout
    help_text = " ".join(help_text.split())  # argparse wraps lines
    assert "exit status: 0 done" in help_text and "3 every teacher request failed" in help_text
    assert "--max-response-bytes" in help_text and "--max-failure-rate" in help_text


@pytest.mark.parametrize(
    ("value", "other_teacher"), [(None, False), ("", True), ("   ", True), (" \t", False)]
)
def test_unset_api_key_env_is_refused_before_any_request(
    tmp_path: Path, value: str | None, other_teacher: bool
) -> None:
    """Issue 50: a teacher whose api_key_env is unset (or empty) failed each of its requests: exit 3 alone,
    exit 0 beside a working teacher (half the requests failed). Now: one line, exit 2, nothing sent or written."""
    var = "COMPOSER_ISSUE50_UNSET_KEY"
    assert var not in os.environ
    with ChatServer() as srv:
        teachers = [{"name": "big", "base_url": srv.base_url, "model": "m2", "api_key_env": var}]
        if other_teacher:
            teachers.insert(0, {"name": "ok", "base_url": srv.base_url, "model": "m1"})
        traces, toml = write_run(tmp_path, teachers)
        rc, out, err = run_cli(
            cli_argv(tmp_path, traces, toml, "--no-progress"), env=None if value is None else {var: value}
        )
        sent = srv.total_requests
    assert (rc, sent) == (2, 0), err
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert "teacher 'big'" in err and f"export {var}=" in err and "drop api_key_env" in err, err
    assert not out and list((tmp_path / "out").iterdir()) == []  # nothing written


@pytest.mark.parametrize("line", ['api_key_env = ""', 'api_key_env = "  "', 'api_key = "sk-1"', "colour = 1"])
def test_bad_teachers_toml_is_refused_in_one_line_before_any_request(tmp_path: Path, line: str) -> None:
    """Issue 62: ``api_key_env = ""`` was taken as "no key" then failed every request (exit 0 beside a
    working teacher); any other bad teachers.toml ended in a traceback (exit 1). Now: one line, exit 2."""
    with ChatServer() as srv:
        teachers = [{"name": "ok", "base_url": srv.base_url, "model": "m1"}]
        traces, toml = write_run(tmp_path, teachers)
        toml.write_text(
            toml.read_text()
            + f'[[teachers]]\nname = "big"\nbase_url = "{srv.base_url}"\nmodel = "m2"\n{line}\n'
        )
        rc, out, err = run_cli(cli_argv(tmp_path, traces, toml, "--no-progress"))
        sent = srv.total_requests
    assert (rc, sent) == (2, 0), err
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert err.startswith("composer-replay: error: ") and "teachers[1]" in err, err
    assert ("api_key_env" in err and "drop" in err) if "api_key_env" in line else True, err
    assert not out and list((tmp_path / "out").iterdir()) == []


# --- cache paths and orphans --------------------------------------------------------------------


@pytest.mark.parametrize("name", ["..", ".", "../../escape", "a/b", "/abs", ".hidden", "x\\..\\y"])
def test_teacher_names_cannot_leave_the_cache(tmp_path: Path, name: str) -> None:
    from composer_core.traces import replay_cli

    work = tmp_path / "work"
    work.mkdir()
    with ChatServer() as srv:
        traces, toml = write_run(work, [{"name": name, "base_url": srv.base_url, "model": "m"}])
        argv = cli_argv(work, traces, toml, "--no-progress")[3:]
        assert replay_cli.main(argv) == 0
        assert replay_cli.main(argv) == 0 and srv.total_requests == 2  # the rerun finds its cache
    cache = work / "out" / "pairs.jsonl.cache"
    entries = list(cache.rglob("*.json"))
    assert len(entries) == 2 and all(p.resolve().is_relative_to(cache.resolve()) for p in entries)
    (teacher_dir,) = cache.iterdir()
    assert teacher_dir.name == ReplayCache.teacher_dir(name) and not teacher_dir.name.startswith(".")
    outside = {
        p.relative_to(tmp_path) for p in tmp_path.rglob("*") if not p.resolve().is_relative_to(work.resolve())
    }
    assert outside == set(), outside
    assert sorted(p.name for p in (work / "out").iterdir()) == [
        "pairs.jsonl", "pairs.jsonl.cache", "pairs.jsonl.failures.jsonl", "pairs.jsonl.summary.json",
    ]  # fmt: skip


def test_orphaned_temp_files_of_a_killed_run_are_removed(tmp_path: Path) -> None:
    """SIGKILL between writing a cache entry's temporary file and renaming it (a real process)."""
    with ChatServer() as srv:
        teachers = [{"name": n, "base_url": srv.base_url, "model": f"m{n}"} for n in ("a", "b")]
        traces, toml = write_run(tmp_path, teachers, n_eps=2)  # 2 eps x 2 turns x 2 teachers = 8
        argv = cli_argv(tmp_path, traces, toml, "--no-progress", "--max-concurrency", "1")
        rc, _, err = run_cli([sys.executable, "-c", KILLED_AT_3RD_CACHE_WRITE, *argv[3:]])
        assert rc == -signal.SIGKILL, err
        cache = tmp_path / "out" / "pairs.jsonl.cache"
        orphans = list(cache.rglob(".tmp-*"))
        assert len(orphans) == 1 and len(list(cache.rglob("*.json"))) == 2 + 1  # 2 entries + the orphan
        rc, _, err = run_cli(argv)
        assert rc == 0, err
        assert not list(cache.rglob(".tmp-*"))
        assert len(list(cache.rglob("*.json"))) == 8
        # the two cached answers were not asked again; the orphan's answer was (it never got cached)
        assert srv.total_requests == 3 + (8 - 2)
    # a live writer's temporary file is left alone
    live = cache / "a" / f".tmp-{os.getppid()}-keep.json"
    live.write_text("{}")
    assert ReplayCache(cache).orphans_removed == 0 and live.exists()
