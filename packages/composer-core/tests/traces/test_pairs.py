"""Preference pairs: majority/verifier selection, filters, and the string-filter-over-messages bug."""

import json

import pytest
from composer_core.traces.pairs import (
    PreferencePair,
    action_key,
    action_length,
    filter_pairs,
    make_pair,
    normalize_text,
)
from composer_core.traces.replay import ReplayResult
from composer_core.traces.schema import Episode, Message, ToolCall


def tc(cmd: str, cid: str = "c") -> Message:
    return Message("assistant", None, (ToolCall(cid, "bash", json.dumps({"cmd": cmd})),))


def episode(student: Message, eid: str = "e") -> Episode:
    return Episode(eid, (Message("user", "fix the bug"), student))


def answers(*msgs: Message | None) -> list[ReplayResult]:
    return [
        ReplayResult(f"t{i}", f"m{i}", f"k{i}", m, None if m else "http 500 (after 5 attempts)", False, 1)
        for i, m in enumerate(msgs)
    ]


def test_majority_chosen_rejected_is_student() -> None:
    ep = episode(tc("rm -rf /"))
    spaced = Message("assistant", None, (ToolCall("b", "bash", '{ "cmd" :\n "pytest" }'),))
    pair = make_pair(ep, 1, answers(tc("pytest", "a"), spaced, tc("ls"), None))
    assert pair is not None and pair.chosen_by == "majority"
    assert action_key(pair.chosen) == action_key(tc("pytest"))  # call ids and JSON layout ignored
    assert action_key(tc("pytest ")) != action_key(tc("pytest"))  # but argument values are kept verbatim
    assert pair.rejected == ep.messages[1] and pair.prompt == ep.messages[:1]
    assert pair.teachers == ("t0", "t1") and pair.answered == 3  # the failed teacher does not vote


def test_no_strict_majority_no_pair() -> None:
    ep = episode(tc("rm -rf /"))
    assert make_pair(ep, 1, answers(tc("a"), tc("b"))) is None
    assert make_pair(ep, 1, answers(tc("a"), tc("a"), tc("b"), tc("c"))) is None  # 2 of 4 is not > half
    assert make_pair(ep, 1, answers(None, None)) is None
    assert make_pair(ep, 1, answers(tc("a"))) is not None  # one teacher is its own majority


def test_teacher_agreeing_with_student_is_not_a_pair() -> None:
    ep = episode(tc("pytest"))
    assert make_pair(ep, 1, answers(tc("pytest", "z"), tc("pytest", "y"))) is None


def test_verifier_overrides_majority() -> None:
    ep = episode(tc("rm -rf /"))
    seen: list[tuple[str, int]] = []

    def verifier(e: Episode, turn: int, m: Message) -> bool:
        seen.append((e.id, turn))
        return "make test" in m.tool_calls[0].arguments

    res = answers(tc("ls"), tc("ls"), tc("make test"))
    pair = make_pair(ep, 1, res, verifier=verifier)
    assert pair is not None and pair.chosen_by == "verifier" and pair.teachers == ("t2",)
    assert seen == [("e", 1)] * 3
    assert make_pair(ep, 1, res, verifier=lambda e, t, m: False) is None  # no fallback to a rejected majority


def pair(chosen: Message, rejected: Message, eid: str = "e", prompt: str = "fix") -> PreferencePair:
    return PreferencePair(eid, 1, (Message("user", prompt),), chosen, rejected, "majority", ("t",), 1)


def test_length_filter_measures_real_action_size() -> None:
    long_call = tc("x" * 500)
    short = Message("assistant", "ok")
    kept, dropped = filter_pairs([pair(long_call, short)], max_chars=100)
    assert kept == [] and dropped["too_long"] == 1
    kept, dropped = filter_pairs([pair(long_call, Message("assistant", "   "))], min_chars=1)
    assert kept == [] and dropped["too_short"] == 1  # whitespace-only content has length 0
    assert action_length(long_call) == len("bash") + len(
        json.dumps({"cmd": "x" * 500}, separators=(",", ":"))
    )


def test_dedupe_on_normalised_structure() -> None:
    a = pair(tc("pytest -q", "id1"), Message("assistant", "done"))
    b = pair(
        Message("assistant", None, (ToolCall("id2", "bash", '{ "cmd" :  "pytest -q" }'),)),
        Message("assistant", "  done\n"),
        eid="other-episode",
    )
    c = pair(tc("pytest -x"), Message("assistant", "done"))
    d = pair(tc("pytest -q"), Message("assistant", "done"), prompt="another state")
    kept, dropped = filter_pairs([a, b, c, d])
    assert kept == [a, c, d] and dropped["duplicate"] == 1
    kept, _ = filter_pairs([a, b], dedupe=False)
    assert kept == [a, b]


def test_string_filter_over_message_lists_is_impossible() -> None:
    """The replaced project ran str filters over list-of-dict fields. Here that raises.

    The old pattern: ``len(row["chosen"])`` / ``row["chosen"].strip()`` / ``"x" in row["chosen"]``
    on ``[{"role": ..., "content": ...}]`` measured the list, not the text (a 1-message list
    of 5000 characters has len 1), so the length filter never fired and the dedupe never matched.
    """
    as_dicts = [{"role": "assistant", "content": "x" * 5000}]
    assert len(as_dicts) == 1  # what the old length filter saw
    with pytest.raises(TypeError, match="normalize_text takes str, got list"):
        normalize_text(as_dicts)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"must be a composer_core\.traces\.Message, got list"):
        action_length(as_dicts)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="got dict"):
        action_key(as_dicts[0])  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"chosen must be a composer_core\.traces\.Message"):
        pair(as_dicts, Message("assistant", "y"))  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="prompt must be a tuple of Message"):
        PreferencePair("e", 1, [{"role": "user"}], tc("a"), tc("b"), "majority", (), 1)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="PreferencePair objects, got dict"):
        filter_pairs([{"chosen": as_dicts, "rejected": as_dicts}])  # type: ignore[list-item]
    # and the typed path measures the text: the 5000-char action is filtered out
    big = Message("assistant", "x" * 5000)
    kept, dropped = filter_pairs([pair(big, Message("assistant", "y"))], max_chars=1000)
    assert kept == [] and dropped["too_long"] == 1


def test_identical_chosen_rejected_rejected() -> None:
    with pytest.raises(ValueError, match="same action"):
        pair(Message("assistant", "run  ls\n"), Message("assistant", " run ls"))


def test_filter_argument_checks() -> None:
    with pytest.raises(ValueError, match="min_chars"):
        filter_pairs([], min_chars=10, max_chars=5)


def test_pipeline_skips_actions_without_context() -> None:
    from composer_core.traces.replay_cli import build_records

    ep = Episode("e", (Message("assistant", "hello"), Message("user", "x"), Message("assistant", "y")))
    res = build_records([ep], None, progress=False)
    assert res.states == 1  # only turn 2: turn 0 has no context to replay
