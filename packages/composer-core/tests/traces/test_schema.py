"""Episode schema, ingesters (OpenAI JSONL, Claude Code session JSONL) and error-site detection."""

import json
from pathlib import Path

import pytest
from composer_core.traces.schema import (
    Episode,
    Message,
    ToolCall,
    episode_from_dict,
    find_error_sites,
    read_claude_code_jsonl,
    read_openai_jsonl,
    read_traces,
    state_hash,
    write_openai_jsonl,
)


def call(cid: str, cmd: str) -> dict:
    return {
        "id": cid,
        "type": "function",
        "function": {"name": "bash", "arguments": json.dumps({"cmd": cmd})},
    }


def episode_dict(eid: str = "e1", tool_output: str = "ok", **tool_extra: object) -> dict:
    return {
        "id": eid,
        "messages": [
            {"role": "system", "content": "You are a coding agent."},
            {
                "role": "user",
                "content": [{"type": "text", "text": "Fix "}, {"type": "text", "text": "the bug."}],
            },
            {"role": "assistant", "content": "Running tests.", "tool_calls": [call("c1", "pytest -q")]},
            {"role": "tool", "tool_call_id": "c1", "content": tool_output, **tool_extra},
            {"role": "assistant", "content": "Done."},
        ],
        "tools": [{"type": "function", "function": {"name": "bash", "parameters": {"type": "object"}}}],
        "metadata": {"task": "t1"},
    }


def test_openai_jsonl_roundtrip(tmp_path: Path) -> None:
    p = tmp_path / "t.jsonl"
    p.write_text(json.dumps(episode_dict()) + "\n\n" + json.dumps(episode_dict("e2")["messages"]) + "\n")
    eps = read_openai_jsonl(p)
    assert [e.id for e in eps] == ["e1", "t-3"]  # bare list gets file-line id
    e = eps[0]
    assert e.messages[1].content == "Fix the bug."  # content parts joined
    assert e.messages[2].tool_calls == (ToolCall("c1", "bash", '{"cmd": "pytest -q"}'),)
    assert e.assistant_turns() == [2, 4]
    assert e.metadata == {"task": "t1"} and e.tools[0]["function"]["name"] == "bash"
    out = tmp_path / "o.jsonl"
    write_openai_jsonl(eps, out)
    assert read_openai_jsonl(out) == eps


@pytest.mark.parametrize(
    ("mutate", "match"),
    [
        (lambda d: d["messages"][0].update(role="robot"), "role must be one of"),
        (lambda d: d["messages"][3].update(tool_call_id="nope"), "unknown call 'nope'"),
        (lambda d: d["messages"][3].pop("tool_call_id"), "needs tool_call_id"),
        (lambda d: d["messages"][1].update(content=[{"type": "audio"}]), "unsupported content part 'audio'"),
        (lambda d: d["messages"][2].update(tool_calls=[{"id": "x"}]), r"tool_calls\[0\]"),
        (lambda d: d.update(messages=[]), "no messages"),
    ],
)
def test_invalid_episodes_name_the_line(tmp_path: Path, mutate, match: str) -> None:
    d = episode_dict()
    mutate(d)
    p = tmp_path / "bad.jsonl"
    p.write_text(json.dumps(episode_dict("ok")) + "\n" + json.dumps(d) + "\n")
    with pytest.raises(ValueError, match=match) as info:
        read_openai_jsonl(p)
    assert "bad.jsonl:2" in str(info.value)


def test_not_json_names_line(tmp_path: Path) -> None:
    p = tmp_path / "x.jsonl"
    p.write_text('{"messages": [{"role": "user", "content": "hi"}]}\n{oops\n')
    with pytest.raises(ValueError, match=r"x.jsonl:2: not valid JSON"):
        read_openai_jsonl(p)


def test_typed_message_rejects_raw_structures() -> None:
    with pytest.raises(TypeError, match="content must be str"):
        Message("user", [{"type": "text", "text": "hi"}])  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="tuple of ToolCall"):
        Message("assistant", None, [{"id": "a"}])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="only assistant"):
        Message("user", "x", (ToolCall("a", "f"),))
    with pytest.raises(TypeError, match="tuple of Message"):
        Episode("e", ({"role": "user", "content": "x"},))  # type: ignore[arg-type]


def claude_lines() -> list[dict]:
    base = {"sessionId": "s1", "isSidechain": False, "cwd": "/w", "version": "2.1.1"}
    return [
        {"type": "summary", "summary": "Fix bug", "leafUuid": "u9"},
        {
            **base,
            "type": "user",
            "uuid": "u1",
            "parentUuid": None,
            "message": {"role": "user", "content": "Fix it"},
        },
        {
            **base,
            "type": "assistant",
            "uuid": "u2",
            "message": {
                "id": "msg_1",
                "role": "assistant",
                "content": [{"type": "thinking", "thinking": "hmm"}],
            },
        },
        {
            **base,
            "type": "assistant",
            "uuid": "u3",
            "message": {
                "id": "msg_1",
                "role": "assistant",
                "content": [{"type": "text", "text": "Running."}],
            },
        },
        {
            **base,
            "type": "assistant",
            "uuid": "u4",
            "message": {
                "id": "msg_1",
                "role": "assistant",
                "content": [
                    {"type": "tool_use", "id": "toolu_1", "name": "Bash", "input": {"command": "make"}}
                ],
            },
        },
        {
            **base,
            "type": "user",
            "uuid": "u5",
            "toolUseResult": {"stdout": "", "stderr": "boom"},
            "message": {
                "role": "user",
                "content": [
                    {
                        "type": "tool_result",
                        "tool_use_id": "toolu_1",
                        "is_error": True,
                        "content": [{"type": "text", "text": "Exit code 2\nmake: *** boom"}],
                    }
                ],
            },
        },
        {**base, "type": "user", "isMeta": True, "message": {"role": "user", "content": "<meta>"}},
        {**base, "type": "user", "isSidechain": True, "message": {"role": "user", "content": "sub-agent"}},
        {**base, "type": "system", "content": "hook ran"},
        {
            **base,
            "type": "assistant",
            "uuid": "u6",
            "message": {"id": "msg_2", "role": "assistant", "content": [{"type": "text", "text": "Fixed."}]},
        },
    ]


def test_claude_code_session(tmp_path: Path) -> None:
    p = tmp_path / "session.jsonl"
    p.write_text("\n".join(json.dumps(x) for x in claude_lines()) + "\n")
    (ep,) = read_claude_code_jsonl(p)
    assert ep.id == "s1"
    roles = [m.role for m in ep.messages]
    assert roles == ["user", "assistant", "tool", "assistant"]  # merged msg_1, skipped meta/sidechain/system
    a = ep.messages[1]
    assert a.content == "Running." and a.tool_calls == (ToolCall("toolu_1", "Bash", '{"command":"make"}'),)
    assert ep.messages[2].is_error is True and ep.messages[2].content.startswith("Exit code 2")
    assert read_traces(p) == [ep]  # auto-detected
    (site,) = find_error_sites(ep)
    assert (site.turn, site.action_turn, site.tool_name, site.exit_code) == (2, 1, "Bash", 2)
    assert set(site.kinds) == {"tool_error", "exit_code"}


def test_claude_code_unknown_block(tmp_path: Path) -> None:
    lines = claude_lines()
    lines[3]["message"]["content"] = [{"type": "server_tool_magic"}]
    p = tmp_path / "s.jsonl"
    p.write_text("\n".join(json.dumps(x) for x in lines))
    with pytest.raises(
        ValueError, match=r"s.jsonl:4: unsupported assistant content block 'server_tool_magic'"
    ):
        read_claude_code_jsonl(p)


@pytest.mark.parametrize(
    ("output", "extra", "kinds", "code"),
    [
        ("===== 2 failed, 3 passed in 0.12s =====", {}, {"test_failure"}, None),
        ("FAILED tests/test_a.py::test_x - assert 1 == 2", {}, {"test_failure"}, None),
        ("Ran 3 tests\n\nFAILED (failures=1)", {}, {"test_failure"}, None),
        ("--- FAIL: TestAdd (0.00s)", {}, {"test_failure"}, None),
        ("Traceback (most recent call last):\n  File x\nKeyError: 'a'", {}, {"tool_error"}, None),
        ("bash: foo: command not found\nexit code: 127", {}, {"tool_error", "exit_code"}, 127),
        ("Process exited with status 3", {}, {"exit_code"}, 3),
        ("all good", {"exit_code": 1}, {"exit_code"}, 1),
        ("all good", {"is_error": True}, {"tool_error"}, None),
    ],
)
def test_error_sites(output: str, extra: dict, kinds: set, code: int | None) -> None:
    ep = episode_from_dict(episode_dict(tool_output=output, **extra), "x")
    (site,) = find_error_sites(ep)
    assert set(site.kinds) == kinds and site.exit_code == code
    assert (site.turn, site.action_turn, site.tool_call_id) == (3, 2, "c1")


@pytest.mark.parametrize(
    "output",
    ["===== 5 passed in 0.10s =====", "exit code: 0", "no errors found", "The error rate is 0%", ""],
)
def test_clean_outputs_are_not_error_sites(output: str) -> None:
    assert find_error_sites(episode_from_dict(episode_dict(tool_output=output), "x")) == []


def test_state_hash_depends_on_content_not_identity() -> None:
    a = episode_from_dict(episode_dict(), "x").messages[:3]
    b = episode_from_dict(episode_dict(), "y").messages[:3]
    assert state_hash(a) == state_hash(b)
    assert state_hash(a) != state_hash(a[:2])
    assert state_hash(a) != state_hash(a, [{"type": "function", "function": {"name": "t"}}])
    # composer extensions (is_error/exit_code) are not part of what a teacher sees
    c = (*a[:2], Message("user", "x", exit_code=1))
    d = (*a[:2], Message("user", "x"))
    assert state_hash(c) == state_hash(d)
