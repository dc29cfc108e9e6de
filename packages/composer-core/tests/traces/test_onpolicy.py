"""``replay_pairs='on_policy'``: which completions of a group are the rejected side (the student's failures)."""

from __future__ import annotations

import math

import pytest
from composer_core.traces.onpolicy import ReplayPairOptions, check_on_policy_columns, failed_rows


def test_every_failure_of_a_group_is_one_pair_and_successes_none() -> None:
    assert failed_rows([1.0, 0.2, 1.0, 0.0], group_size=4, threshold=1.0) == [1, 3]
    assert failed_rows([1.0, 1.0, 1.0, 1.0, 0.5, 1.0, 0.0, 0.9], group_size=4, threshold=1.0) == [4, 6, 7]
    assert failed_rows([1.0] * 8, group_size=4, threshold=1.0) == []
    assert failed_rows([0.6, 0.4], group_size=2, threshold=0.5) == [1]  # at the threshold is a success


def test_unscorable_completion_is_no_failure() -> None:
    assert failed_rows([math.nan, 0.0], group_size=2, threshold=1.0) == [1]


def test_bad_group_and_options_raise() -> None:
    with pytest.raises(ValueError, match="groups of 4"):
        failed_rows([0.0] * 6, group_size=4, threshold=1.0)
    with pytest.raises(ValueError, match="replay_pairs"):
        ReplayPairOptions(replay_pairs="offline")  # type: ignore[arg-type]


def test_on_policy_columns() -> None:
    check_on_policy_columns({"prompt", "chosen"})
    with pytest.raises(ValueError, match=r"needs a `chosen` column.*replay_pairs='columns'"):
        check_on_policy_columns({"prompt"})
    with pytest.raises(ValueError, match=r"\['rejected'\] would be ignored: drop the column"):
        check_on_policy_columns({"prompt", "chosen", "rejected"})
