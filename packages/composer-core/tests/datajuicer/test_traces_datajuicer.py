"""composer_core.traces.datajuicer against the real py-data-juicer (nox -s tests-core-datajuicer)."""

import json

import pytest
from composer_core.traces.datajuicer import action_text, datajuicer_filter
from composer_core.traces.pairs import PreferencePair
from composer_core.traces.schema import Message, ToolCall


def call(cmd: str, cid: str = "c") -> Message:
    return Message("assistant", None, (ToolCall(cid, "bash", json.dumps({"cmd": cmd})),))


def pair(chosen: Message, rejected: Message, prompt: str = "fix the bug") -> PreferencePair:
    return PreferencePair("e", 1, (Message("user", prompt),), chosen, rejected, "majority", ("t",), 1)


def test_filters_and_dedupe_on_action_text() -> None:
    short = pair(call("pytest -q"), Message("assistant", "I am done"))
    long_args = pair(
        call("x" * 3000), Message("assistant", "I am done")
    )  # long only inside the tool-call args
    dup = pair(call("pytest -q", "other-id"), Message("assistant", "I am done"), prompt="another state")
    other = pair(Message("assistant", "Run make test first."), call("rm -rf build"))
    kept, dropped = datajuicer_filter(
        [short, long_args, dup, other],
        [{"text_length_filter": {"min_len": 5, "max_len": 200}}, {"document_deduplicator": {}}],
    )
    # the length filter measured the tool-call arguments (a str() of a message list would not be 3000+)
    assert kept == [short, other] and dropped == 2


def test_ops_can_target_the_rejected_text() -> None:
    from data_juicer.ops.filter import TextLengthFilter

    a = pair(call("ls"), Message("assistant", "y" * 500))
    b = pair(call("ls"), Message("assistant", "ok then"))
    kept, dropped = datajuicer_filter(
        [a, b], [TextLengthFilter(min_len=1, max_len=100, text_key="rejected_text", num_proc=1)]
    )
    assert kept == [b] and dropped == 1


def test_mappers_and_raw_dicts_are_refused() -> None:
    with pytest.raises(ValueError, match="only ops that keep or drop whole rows"):
        datajuicer_filter([pair(call("ls"), call("pwd"))], [{"whitespace_normalization_mapper": {}}])
    with pytest.raises(TypeError, match="must be a PreferencePair, got dict"):
        datajuicer_filter([{"chosen": [{"role": "assistant", "content": "x"}]}], [])  # type: ignore[list-item]
    with pytest.raises(TypeError, match="takes a Message"):
        action_text([{"role": "assistant", "content": "x"}])  # type: ignore[arg-type]


def test_action_text() -> None:
    m = Message(
        "assistant", "Running.", (ToolCall("a", "bash", '{"cmd": "ls"}'), ToolCall("b", "read", "{}"))
    )
    assert action_text(m) == 'Running.\nbash {"cmd": "ls"}\nread {}'
