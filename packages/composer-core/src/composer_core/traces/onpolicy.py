"""Channel 3 as trace replay of the student's own failures (``replay_pairs="on_policy"``), shared by the adapters:
each failed completion of a group (:func:`failed_rows`) is the rejected side of a pair whose chosen side is the
row's ``chosen`` (a ``composer-replay`` record's, a teacher column or the reference answer); a group without a
failure gives none, and the replay normaliser stays the global pair count.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Literal, get_args

from composer_core.loss.options import _opt
from composer_core.loss.validation import check_choice, check_int

__all__ = ["REPLAY_PAIRS", "ReplayPairOptions", "ReplayPairs", "check_on_policy_columns", "failed_rows"]

ReplayPairs = Literal["columns", "on_policy"]
REPLAY_PAIRS: tuple[str, ...] = get_args(ReplayPairs)
#: the columns a ``"on_policy"`` pair never reads (its rejected side is the student's own completion)
_REJECTED_COLUMNS = ("rejected", "rejected_mask", "ref_rejected_logps", "ref_rejected_logp")


@dataclass(frozen=True)
class ReplayPairOptions:
    """Where channel 3's pairs come from (flat name ``replay_pairs``): ``"columns"`` or ``"on_policy"``."""

    replay_pairs: ReplayPairs = _opt(
        "columns",
        "'columns' (pairs from the dataset's chosen/rejected columns) or 'on_policy' (each failed completion of the group, reward < success_reward_threshold, is the rejected side of a pair whose chosen side is the row's `chosen` column; no `rejected` column).",
    )

    def __post_init__(self) -> None:
        check_choice("replay_pairs", self.replay_pairs, REPLAY_PAIRS)


def failed_rows(rewards: Sequence[float], group_size: int, threshold: float) -> list[int]:
    """Indices of the completions that form an on-policy pair: reward < ``threshold``.

    ``rewards``: one scalar per completion of the generation batch, groups of ``group_size`` consecutive rows
    (all processes, in order). A NaN reward (unscorable) is no failure: nothing says the teacher's answer beats it.
    """
    check_int("group_size", group_size, low=1)
    if len(rewards) % group_size:
        raise ValueError(f"{len(rewards)} rewards do not split into groups of {group_size} (num_generations)")
    return [i for i, r in enumerate(rewards) if not math.isnan(float(r)) and float(r) < threshold]


def check_on_policy_columns(columns: Collection[str]) -> None:
    """Raise (one line with the fix) unless ``columns`` hold ``chosen`` and no rejected-side column."""
    if "chosen" not in columns:
        raise ValueError(
            "replay_pairs='on_policy' needs a `chosen` column (a teacher's answer to the prompt: a composer-replay "
            "record's `chosen`, a teacher column or the reference answer); add it or use replay_pairs='columns'."
        )
    extra = sorted(set(columns) & set(_REJECTED_COLUMNS))
    if extra:
        raise ValueError(
            f"replay_pairs='on_policy' takes the rejected side from the student's failed completions, so {extra} "
            "would be ignored: drop the column(s) or use replay_pairs='columns'."
        )
