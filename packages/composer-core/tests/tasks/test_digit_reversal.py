"""The embedded digit-reversal task: one reward rule, one hint rule, one oracle, one id mapping."""

from __future__ import annotations

import importlib.util

import pytest
from composer_core.tasks import digit_reversal as T
from composer_core.tasks import tiny


def test_oracle_and_rejected_side() -> None:
    assert T.oracle_solve("3817>") == "7183"
    assert T.oracle_solve(".8.|381>") == "183"  # a hinted prompt has the same answer
    assert T.wrong_solution("381>") == "381"
    for p in ("121>", "777>", "1>"):  # a palindrome's copy would be right: the rejected side never is
        assert T.verify(p, T.wrong_solution(p)) < 1.0
    with pytest.raises(ValueError, match="not a digit-reversal prompt"):
        T.oracle_solve("abc>")


def test_reward_rule_partial_credit_over_the_longer_string() -> None:
    assert T.verify("381>", "183") == 1.0
    assert T.verify("381>", " 183\n") == 1.0  # surrounding whitespace is ignored
    assert T.verify("381>", "133") == pytest.approx(2 / 3)
    assert T.verify("381>", "1833") == pytest.approx(3 / 4)  # extra characters cost
    assert T.verify("381>", "18") == pytest.approx(2 / 3)  # missing ones too
    assert T.verify("381>", "") == 0.0
    assert T.reverse_reward(["381>", "12>"], ["183", "11"]) == [1.0, 0.5]


def test_hint_rule_marks_wrong_positions_and_is_none_when_right() -> None:
    assert T.feedback_hint("381>", "133") == ".8.|"
    assert T.feedback_hint("381>", "1") == ".83|"
    assert T.feedback_hint("381>", "") == "183|"
    assert T.feedback_hint("381>", "183") is None
    assert T.hint_template("381>", ".8.|") == ".8.|381>"
    assert T.reverse_hints(["381>", "381>"], ["183", "999"]) == [None, "183|"]
    # the hint's length depends only on the prompt: equal-length prompts give equal-length contexts
    assert {len(T.feedback_hint("381>", c) or "") for c in ("", "1", "99999", "183x")} == {4}


def test_dataset_rows_are_reproducible_and_consistent() -> None:
    rows = T.make_dataset_rows(20, min_digits=2, max_digits=4, seed=5)
    assert rows == T.make_dataset_rows(20, min_digits=2, max_digits=4, seed=5)
    assert rows != T.make_dataset_rows(20, min_digits=2, max_digits=4, seed=6)
    for r in rows:
        assert 2 <= len(T.prompt_digits(r["prompt"])) <= 4
        assert T.verify(r["prompt"], r["chosen"]) == 1.0 and T.verify(r["prompt"], r["rejected"]) < 1.0
    with pytest.raises(ValueError, match="n must be >= 1"):
        T.make_dataset_rows(0)
    with pytest.raises(ValueError, match="min_digits <= max_digits"):
        T.make_dataset_rows(3, min_digits=4, max_digits=3)


def test_token_ids_encode_decode() -> None:
    assert tiny.char_vocab(T.ALPHABET) == T.VOCAB
    assert (T.VOCAB["<pad>"], T.VOCAB["<eos>"], T.VOCAB["<bos>"]) == (tiny.PAD_ID, tiny.EOS_ID, tiny.BOS_ID)
    assert len(T.VOCAB) == 3 + len(T.ALPHABET) == 16
    ids = T.encode(".8.|381>")
    assert ids == [15, 11, 15, 14, 6, 11, 4, 13]
    assert T.decode(ids) == ".8.|381>"
    # decoding stops at EOS and skips pad/bos, as TRL's batch_decode(skip_special_tokens=True) of a
    # completion cut at its EOS does
    assert T.decode([tiny.BOS_ID, *T.encode("18"), tiny.PAD_ID, *T.encode("3"), tiny.EOS_ID, 5]) == "183"
    with pytest.raises(ValueError, match="outside the task alphabet"):
        T.encode("38a")
    with pytest.raises(ValueError, match="repeated characters"):
        tiny.char_vocab("aa")


@pytest.mark.skipif(importlib.util.find_spec("transformers") is not None, reason="hf extra installed")
def test_tiny_builders_without_transformers_name_the_extra() -> None:
    with pytest.raises(ImportError, match=r"composer-core\[hf\]"):
        tiny.build_tiny_qwen2(16)
    with pytest.raises(ImportError, match=r"composer-core\[hf\]"):
        tiny.build_char_tokenizer(T.ALPHABET)
