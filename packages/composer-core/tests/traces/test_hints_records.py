"""Hinted contexts (message level) and the record schema (JSONL, validation on read)."""

import json
from pathlib import Path

import pytest
from composer_core.traces.hints import (
    TemplateHint,
    build_hinted_context,
    error_text_hint,
    hint_token_span,
    render_plain,
)
from composer_core.traces.records import TraceRecord, read_records, validate_record, write_records
from composer_core.traces.schema import Episode, Message, ToolCall, find_error_sites

FAIL = "===== 1 failed, 1 passed in 0.01s =====\n" + "E   assert 2 == 3\n" * 200


def episode() -> Episode:
    return Episode(
        "e1",
        (
            Message("system", "You are a coding agent."),
            Message("user", "Make the tests pass."),
            Message("assistant", "Running.", (ToolCall("c1", "bash", '{"cmd": "pytest"}'),)),
            Message("tool", FAIL, tool_call_id="c1"),
            Message("assistant", "Done."),
        ),
    )


def test_teacher_context_is_student_context_plus_hint() -> None:
    ep = episode()
    (site,) = find_error_sites(ep)
    ctx = build_hinted_context(ep, site, error_text_hint(max_chars=100))
    assert ctx.prompt == ep.messages[:2] and ctx.completion == ep.messages[2]
    k = ctx.hint_index
    assert k == 2 and ctx.teacher_prompt[k] == Message("user", ctx.hint)
    assert ctx.teacher_prompt[:k] + ctx.teacher_prompt[k + 1 :] == ctx.prompt  # differ only by the hint
    assert "`bash`" in ctx.hint and "1 failed" in ctx.hint and "[...]" in ctx.hint
    assert len(ctx.hint) < 250  # truncated
    sys_ctx = build_hinted_context(ep, site, error_text_hint(), role="system")
    assert sys_ctx.teacher_prompt[2].role == "system"


def test_plain_rendering_differs_only_by_the_hint() -> None:
    ep = episode()
    ctx = build_hinted_context(
        ep, find_error_sites(ep)[0], TemplateHint("Try `{tool_name}` with -x ({kinds})")
    )
    plain = render_plain(ctx.prompt, add_generation_prompt=True)
    hinted = render_plain(ctx.teacher_prompt, add_generation_prompt=True)
    hint_block = render_plain([ctx.teacher_prompt[ctx.hint_index]])
    cut = len(render_plain(ctx.prompt[: ctx.hint_index]))
    assert hinted == plain[:cut] + hint_block + plain[cut:]
    assert ctx.hint == "Try `bash` with -x (test_failure)"


def test_template_fields_checked_up_front() -> None:
    with pytest.raises(ValueError, match=r"unknown fields \['stdout'\]"):
        TemplateHint("see {stdout}")
    ep = episode()
    site = find_error_sites(ep)[0]
    t = TemplateHint("{tool_name} {arguments} exit={exit_code} {error}", max_chars=20)
    assert t(ep, site).startswith('bash {"cmd": "pytest"} exit= ')


def test_empty_hint_is_an_error() -> None:
    ep = episode()
    with pytest.raises(ValueError, match="empty hint"):
        build_hinted_context(ep, find_error_sites(ep)[0], lambda e, s: "  ")


def test_hint_token_span() -> None:
    assert hint_token_span([1, 2, 3, 4], [1, 2, 9, 9, 3, 4]) == (2, 4)
    assert hint_token_span([1, 2], [1, 2, 7]) == (2, 3)
    with pytest.raises(ValueError, match="differ outside one inserted run"):
        hint_token_span([1, 2, 3, 4], [1, 9, 2, 3, 8, 4])
    with pytest.raises(ValueError, match="not longer"):
        hint_token_span([1, 2], [1, 2])


def record(**kw: object) -> dict:
    ep = episode()
    ctx = build_hinted_context(ep, find_error_sites(ep)[0], error_text_hint())
    row = {
        "id": "e1@2",
        "episode_id": "e1",
        "turn": 2,
        "prompt": [m.to_dict() for m in ctx.prompt],
        "completion": [ctx.completion.to_dict()],
        "teacher_prompt": [m.to_dict() for m in ctx.teacher_prompt],
        "hint": ctx.hint,
        "hint_index": ctx.hint_index,
        "tokenizer": "toy",
        "prompt_ids": [1, 2, 3],
        "teacher_prompt_ids": [1, 2, 9, 3],
        "completion_ids": [5, 6, 7],
        "sdpo_mask": [0, 1, 1],
        "chosen": [{"role": "assistant", "content": "pytest -x first"}],
        "rejected": [ctx.completion.to_dict()],
        "chosen_by": "majority",
        "chosen_teachers": ["a", "b"],
        "ref_chosen_logp": -3.5,
        "ref_rejected_logp": -7.25,
    }
    row.update(kw)
    return row


def test_records_roundtrip_jsonl(tmp_path: Path) -> None:
    rec = validate_record(record())
    p = tmp_path / "r.jsonl"
    assert write_records([rec, TraceRecord(**{**rec.to_dict(), "id": "e1@2b"})], p) == 2
    back = read_records(p)
    assert back[0] == rec and back[0].has_sdpo and back[0].has_pair
    row = json.loads(p.read_text().splitlines()[0])
    assert set(row) == set(rec.to_dict())  # every documented column is written


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"sdpo_mask": [1, 1]}, "sdpo_mask has 2 entries but completion_ids 3"),
        ({"sdpo_mask": [0, 0, 0]}, "all zero"),
        ({"sdpo_mask": [0, 2, 1]}, "only 0 and 1"),
        ({"tokenizer": None}, "without tokenizer"),
        ({"hint_index": 1}, "prompt with one hint message"),
        ({"hint": "another hint"}, "prompt with one hint message"),
        ({"chosen": None}, "chosen and rejected together"),
        ({"chosen": [{"role": "user", "content": "x"}]}, "exactly one assistant message"),
        (
            {"rejected": [{"role": "assistant", "content": "something else"}]},
            "rejected must be the student's action",
        ),
        ({"ref_rejected_logp": None}, "together"),
        ({"ref_chosen_logp": float("nan")}, "finite"),
        (
            {"completion": [{"role": "assistant", "content": "a"}, {"role": "assistant", "content": "b"}]},
            "exactly one",
        ),
        ({"prompt": "Make the tests pass."}, "prompt must be a list of OpenAI chat messages"),
        ({"prompt": [{"role": "user", "content": 5}]}, r"prompt\[0\]"),
        ({"colour": "red"}, r"unknown columns \['colour'\]"),
        ({"turn": -1}, "non-negative"),
        (
            {
                "teacher_prompt": None,
                "chosen": None,
                "rejected": None,
                "ref_chosen_logp": None,
                "ref_rejected_logp": None,
            },
            "needs channel 2",
        ),
    ],
)
def test_validation_on_read(tmp_path: Path, change: dict, match: str) -> None:
    p = tmp_path / "bad.jsonl"
    p.write_text(json.dumps(record()) + "\n" + json.dumps(record(id="x", **change)) + "\n")
    with pytest.raises(ValueError, match=match) as info:
        read_records(p)
    assert "bad.jsonl:2" in str(info.value)


def test_duplicate_ids_rejected(tmp_path: Path) -> None:
    p = tmp_path / "dup.jsonl"
    p.write_text(json.dumps(record()) + "\n" + json.dumps(record()) + "\n")
    with pytest.raises(ValueError, match="duplicate record ids"):
        read_records(p)
