"""Two-digit addition for a real model: answer extraction, partial credit, feedback without the sum, splits."""

from __future__ import annotations

import pytest
from composer_core.tasks import addition as A

P = "Compute 47 + 38. Reply with just the result."


def test_answer_is_the_number_after_the_last_equals_sign_else_the_first_number() -> None:
    assert A.extract_answer("47 + 38 = 85") == 85
    assert A.extract_answer("47 + 38 = 85.\n\nThe sum is") == 85
    assert A.extract_answer("85") == 85
    assert A.extract_answer("The answer is 75, I think") == 75
    assert A.extract_answer("47 + 38 =") is None
    assert A.extract_answer("no idea") is None


def test_reward_is_one_only_for_the_sum_and_half_the_right_digits_otherwise() -> None:
    assert A.verify(P, "47 + 38 = 85") == 1.0
    assert A.verify([{"role": "user", "content": P}], [{"role": "assistant", "content": "85"}]) == 1.0
    assert A.verify(P, "47 + 38 = 75") == pytest.approx(0.25)  # units right, tens wrong
    assert A.verify(P, "47 + 38 = 185") == pytest.approx(
        0.5 * 2 / 3
    )  # aligned from the right: "085" vs "185"
    assert A.verify(P, "47 + 38 = 14") == 0.0
    assert A.verify(P, "I cannot") == 0.0
    assert A.addition_reward([P, P], ["85", "84"]) == [1.0, 0.25]


def test_feedback_names_the_wrong_places_never_the_sum() -> None:
    assert A.feedback(P, "47 + 38 = 85") is None
    text = A.feedback(P, "47 + 38 = 75")
    assert text is not None and "tens digit is wrong" in text and "too small" in text and "carry" in text
    assert "85" not in text
    text = A.feedback("Compute 12 + 13. Reply with just the result.", "12 + 13 = 35")
    assert text == "35 is wrong (too large): the tens digit is wrong."
    assert "has no number" in (A.feedback(P, "hmm") or "")
    assert A.addition_feedback([P], ["85"]) == [None]


def test_reference_and_rejected_sides() -> None:
    assert A.reference_answer(P) == "47 + 38 = 85"
    assert A.wrong_answer(P) == "47 + 38 = 75"  # the sum without the carry
    assert (
        A.wrong_answer("Compute 12 + 13. Reply with just the result.") == "12 + 13 = 26"
    )  # no carry: one off
    for row in A.make_rows(50, seed=3):
        assert A.verify(row["prompt"], row["chosen"]) == 1.0
        assert A.verify(row["prompt"], row["rejected"]) < 1.0
        assert row["answer"] == str(sum(A.operands(row["prompt"])))


def test_splits_are_disjoint_reproducible_and_chat_formatted() -> None:
    train, held = A.split_rows(0, 200, 32)
    assert len(train) == 200 and len(held) == 32
    pairs = lambda rows: {A.operands(r["prompt"]) for r in rows}  # noqa: E731
    assert not pairs(train) & pairs(held)
    assert len(pairs(train)) == 200
    assert A.split_rows(0, 200, 32) == (train, held)
    assert A.split_rows(1, 200, 32)[1] != held
    assert train[0]["prompt"][0]["role"] == "user"
    assert isinstance(A.make_rows(1, chat=False)[0]["prompt"], str)


def test_bad_input_is_one_clear_error() -> None:
    with pytest.raises(ValueError, match="not an addition prompt"):
        A.verify("Reverse 123", "321")
    with pytest.raises(ValueError, match="n must lie in"):
        A.make_rows(0)
