"""hint_jobs / load_hint_fn: the hint -> re-score step shared by the verl and PRIME-RL producers."""

from __future__ import annotations

import pytest
from composer_core.traces.hints import HintJob, hint_jobs, load_hint_fn


def test_hint_jobs_keep_hinted_rows_in_order_with_their_index() -> None:
    rows = ["a", "b", "c", "d"]
    answers = {"a": "fix a", "b": None, "c": "  ", "d": "fix d"}
    jobs = hint_jobs(rows, answers.get, option="composer.hint_fn", template="Hint: {hint}")
    assert jobs == [HintJob(0, "a", "Hint: fix a"), HintJob(3, "d", "Hint: fix d")]


def test_skipped_rows_are_not_asked() -> None:
    asked: list[str] = []

    def hint_of(row: str) -> str:
        asked.append(row)
        return "h"

    assert [j.index for j in hint_jobs(["a", "b", "c"], hint_of, option="x", skip={1})] == [0, 2]
    assert asked == ["a", "c"]


def test_non_string_answers_and_bad_templates_name_the_option() -> None:
    with pytest.raises(ValueError, match=r"composer\.hint_fn answered int for row 0"):
        hint_jobs(["a"], lambda r: 3, option="composer.hint_fn")
    with pytest.raises(ValueError, match="must contain"):
        hint_jobs(["a"], lambda r: "h", option="x", template="no placeholder")


def test_load_hint_fn_accepts_both_path_forms_and_names_the_option() -> None:
    assert load_hint_fn("os.path:join", option="k") is load_hint_fn("os.path.join", option="k")
    for bad, why in (
        ("os.path:nope", "cannot be imported"),
        ("os.path:sep", "not callable"),
        ("x", "expected"),
    ):
        with pytest.raises(ValueError, match=rf"^k={bad!r}.*{why}"):
            load_hint_fn(bad, option="k")
