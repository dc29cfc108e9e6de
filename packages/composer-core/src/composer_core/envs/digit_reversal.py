"""The embedded digit-reversal task as an in-process :class:`~composer_core.envs.Environment` (``--env digit-reversal``).

The rules are :mod:`composer_core.tasks.digit_reversal`'s: the reward is ``verify``, the feedback
``feedback_hint``, the reference the oracle's answer and ``info["rejected"]`` the typical mistake.
``max_attempts`` > 1 makes it multi-turn: a wrong answer before the last attempt gets reward 0, ``done=False``
and the feedback; the episode ends at the first correct answer (reward 1) or at the last attempt (reward =
``verify`` of that answer). Task ids are ``"<split>:<digits>"``, so :meth:`DigitReversalEnv.task` rebuilds
any task from its id.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from composer_core.tasks import digit_reversal as dr

from .base import EnvError, EnvTask, StepResult

__all__ = ["SPLIT_SEEDS", "DigitReversalEnv", "DigitReversalSession"]

SPLIT_SEEDS = {"train": 0, "eval": 10_000, "test": 20_000}
"""Seed offset of each split (added to the environment's ``seed``)."""


class DigitReversalSession:
    """One episode of :class:`DigitReversalEnv`."""

    def __init__(self, task: EnvTask, max_attempts: int) -> None:
        self.prompt = task.prompt if isinstance(task.prompt, str) else task.prompt[-1].text
        self.max_attempts = max_attempts
        self.attempts = 0
        self.done = False

    def step(self, action: str) -> StepResult:
        if self.done:
            raise EnvError(f"digit-reversal: step after the episode ended ({self.attempts} attempts)")
        self.attempts += 1
        reward = dr.verify(self.prompt, action)
        feedback = dr.feedback_hint(self.prompt, action)
        self.done = feedback is None or self.attempts >= self.max_attempts
        info = {"attempt": self.attempts, "score": reward}
        return StepResult(reward if self.done else 0.0, self.done, feedback, None, info)

    def close(self) -> None:
        self.done = True


@dataclass
class DigitReversalEnv:
    """The embedded task (see the module docstring). ``n_tasks`` per split, reproducible by ``seed``."""

    n_tasks: int = 64
    min_digits: int = 3
    max_digits: int = 3
    seed: int = 0
    max_attempts: int = 1
    name: str = "digit-reversal"

    def __post_init__(self) -> None:
        if self.max_attempts < 1:
            raise ValueError(f"max_attempts must be >= 1, got {self.max_attempts}")
        if self.n_tasks < 1:
            raise ValueError(f"n_tasks must be >= 1, got {self.n_tasks}")
        dr.make_dataset_rows(1, min_digits=self.min_digits, max_digits=self.max_digits)  # checks the range

    def tasks(self, split: str = "train", limit: int | None = None) -> Sequence[EnvTask]:
        if split not in SPLIT_SEEDS:
            raise ValueError(f"digit-reversal has splits {sorted(SPLIT_SEEDS)}, not {split!r}")
        n = self.n_tasks if limit is None else min(limit, self.n_tasks)
        if n < 1:
            raise ValueError(f"limit must be >= 1, got {limit}")
        rows = dr.make_dataset_rows(
            n, min_digits=self.min_digits, max_digits=self.max_digits, seed=self.seed + SPLIT_SEEDS[split]
        )
        return [self.task(f"{split}:{dr.prompt_digits(r['prompt'])}") for r in rows]

    def task(self, task_id: str) -> EnvTask:
        """The task with id ``"<split>:<digits>"``."""
        split, _, digits = task_id.partition(":")
        if split not in SPLIT_SEEDS or not digits.isdigit():
            raise ValueError(f"not a digit-reversal task id: {task_id!r} (expected '<split>:<digits>')")
        prompt = dr.make_prompt(digits)
        return EnvTask(
            task_id, prompt, reference=dr.oracle_solve(prompt), info={"rejected": dr.wrong_solution(prompt)}
        )

    def reset(self, task: EnvTask) -> DigitReversalSession:
        return DigitReversalSession(task, self.max_attempts)
