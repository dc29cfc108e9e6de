"""Two-digit addition for a real model: answer extraction, partial credit, feedback without the sum, splits."""

from __future__ import annotations

import pytest
from composer_core.tasks import addition as A

P = "Compute 47 + 38. Reply with just the result."


Q = "Compute 34 + 44. Reply with just the result."


@pytest.mark.parametrize(
    ("reply", "want"),
    [
        ("47 + 38 = 85", 85),
        ("34 + 44 = 78.", 78),
        ("78", 78),
        ("78.", 78),
        ("**78**", 78),
        ("34 + 44 = 34", 34),  # a stated result, even an operand
        ("34 + 44 equals 78.", 78),
        ("The sum of 34 and 44 is 78.", 78),
        ("The result is 78.", 78),
        ("Result: 78", 78),
        ("To compute 34 + 44, we simply add them together: 78.", 78),
        ("To compute 34 + 44, we need to add 34 and 44, which results in 78.", 78),
        ("To compute 34 + 44, we simply add them together: 34 + 44 = 78.", 78),
        ("34 + 44 = 78\n\nI'm ready to help. What's your next question?", 78),  # trailing text
        ("34 + 44 equals 78, and 78 is indeed 34 + 44.", 78),
        ("The answer is 75, I think", 75),
        ("34 + 44 = 30 + 40 + 8 = 78", 78),  # a chain: its last result
    ],
)
def test_answer_is_the_number_the_reply_states_as_its_result(reply: str, want: int) -> None:
    assert A.extract_answer(reply, operands=(34, 44)) == want
    assert A.extract_answer(reply) == want


@pytest.mark.parametrize(
    "reply",
    [
        "To compute 34 + 44, we simply add them together:",  # cut off before the sum
        "To compute 34 + 44, we need to add 34 and 44",
        "34 + 44 =",
        "34 + 44",
        "What is 34 + 44?",
        "The answer is 34 + 44",  # the operands restated as an expression, no result
        "The sum of 34 and 44 is",
        "This is 2-digit addition.",
        "34",  # the first operand alone: a reply cut off after "34" (restating "34 + 44") states no result
        "44.",
        "no idea",
        "",
    ],
)
def test_a_reply_without_a_stated_result_has_no_answer(reply: str) -> None:
    assert A.extract_answer(reply, operands=(34, 44)) is None
    assert A.verify(Q, reply) == 0.0
    assert A.feedback(Q, reply) == "The reply does not state a result for 34 + 44."


def test_feedback_on_a_wrong_answer_names_only_the_number_the_reply_gave() -> None:
    text = A.feedback(Q, "To compute 34 + 44, we simply add them together: 34 + 44 = 68.")
    assert text == "68 is wrong (too small): the tens digit is wrong."
    assert A.feedback(Q, "34 + 44 equals 79") == "79 is wrong (too large): the units digit is wrong."
    assert A.feedback(Q, "The result is 78.") is None
    assert A.FEEDBACK_REVEALS.startswith("verifier feedback: wrong digit places, direction, carry hint")


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
    assert A.feedback(P, "hmm") == "The reply does not state a result for 47 + 38."
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


def test_held_out_and_validation_are_fixed_for_every_seed_and_disjoint_from_training() -> None:
    pairs = lambda rows: {A.operands(r["prompt"]) for r in rows}  # noqa: E731
    s0, s1 = A.task_splits(0, 200), A.task_splits(1, 200)
    assert (len(s0.train), len(s0.validation), len(s0.held_out)) == (200, 128, 256)
    assert (A.VALIDATION_SIZE, A.HELD_OUT_SIZE) == (128, 256)
    assert s1.held_out == s0.held_out and s1.validation == s0.validation  # the same sums for every seed
    assert s1.train != s0.train
    for s in (s0, s1):
        assert (
            len(pairs(s.train)) == 200 and len(pairs(s.validation)) == 128 and len(pairs(s.held_out)) == 256
        )
        assert not pairs(s.train) & pairs(s.held_out)
        assert not pairs(s.train) & pairs(s.validation)
        assert not pairs(s.validation) & pairs(s.held_out)
    assert A.task_splits(0, 200) == s0
    assert s0.train[0]["prompt"][0]["role"] == "user"
    assert isinstance(A.task_splits(0, 4, chat=False).held_out[0]["prompt"], str)
    assert isinstance(A.make_rows(1, chat=False)[0]["prompt"], str)


def test_split_rows_takes_a_prefix_of_the_fixed_held_out_set() -> None:
    train, held = A.split_rows(0, 200, 32)
    assert held == A.task_splits(0, 1).held_out[:32] == A.split_rows(5, 10, 32)[1]
    assert train == A.task_splits(0, 200).train
    with pytest.raises(ValueError, match="n_held must lie in"):
        A.split_rows(0, 10, 257)


def test_bad_input_is_one_clear_error() -> None:
    with pytest.raises(ValueError, match="not an addition prompt"):
        A.verify("Reverse 123", "321")
    with pytest.raises(ValueError, match="n must lie in"):
        A.make_rows(0)
