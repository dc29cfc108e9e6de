"""The embedded verifiable task of ``composer-train`` (digit reversal), re-exported from composer-core.

The task's single definition (prompts, reward rule, hint rule, oracle answer) is
:mod:`composer_core.tasks.digit_reversal`; this module keeps the ``composer_trl.task`` names that
recipes (``hint_fn = "composer_trl.task:reverse_hints"``) and user code already import.
"""

from composer_core.tasks.digit_reversal import (
    ALPHABET,
    feedback_hint,
    hint_template,
    make_dataset_rows,
    make_prompt,
    oracle_solve,
    reverse_hints,
    reverse_reward,
    verify,
    wrong_solution,
)

__all__ = [
    "ALPHABET",
    "feedback_hint",
    "hint_template",
    "make_dataset_rows",
    "make_prompt",
    "oracle_solve",
    "reverse_hints",
    "reverse_reward",
    "verify",
    "wrong_solution",
]
