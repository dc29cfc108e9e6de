"""An environment as TRL-style callables (``f(prompts=..., completions=..., **dataset_columns)``, no TRL import;
the README's ``env_dataset_rows`` row). The reward and hint functions of one environment share one
:class:`EnvScorer`, so a completion's reward and hint come from **one** step. An environment fault raises
:class:`~composer_core.envs.EnvError`: a training step never continues on a reward it could not compute.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, TypeVar

from .base import Environment, EnvTask, StepResult
from .episodes import _bounded_step, _call_bounded, _close_quietly

R = TypeVar("R")

__all__ = ["EnvScorer", "env_dataset_rows", "env_hint_func", "env_reward_func", "scorer_for"]


class EnvScorer:
    """Single-step scoring of ``(task_id, completion)`` with a bounded LRU cache (see the module docstring)."""

    def __init__(self, env: Environment, *, timeout_s: float = 30.0, cache_size: int = 4096) -> None:
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        self.env, self.timeout_s, self.cache_size = env, timeout_s, cache_size
        self._tasks: dict[str, EnvTask] = {}
        self.score: Callable[[str, str], StepResult] = functools.lru_cache(cache_size)(self._step)

    def register(self, tasks: Iterable[EnvTask]) -> None:
        for t in tasks:
            self._tasks[t.task_id] = t

    def task(self, task_id: str) -> EnvTask:
        if task_id in self._tasks:
            return self._tasks[task_id]
        lookup = getattr(self.env, "task", None)
        if callable(lookup):
            found = lookup(task_id)
            if isinstance(found, EnvTask):
                self._tasks[task_id] = found
                return found
        raise ValueError(
            f"task_id {task_id!r} is unknown to environment {self.env.name!r}; build the dataset with "
            "composer_core.envs.env_dataset_rows(env) so every row's task_id is registered"
        )

    def _step(self, task_id: str, completion: str) -> StepResult:
        """One step of a fresh episode of ``task_id`` (:attr:`score` is this, cached)."""
        task = self.task(task_id)
        session = _call_bounded(lambda: self.env.reset(task), self.timeout_s, f"{self.env.name} reset")
        try:
            return _bounded_step(self.env, session, completion, self.timeout_s)
        finally:
            _close_quietly(self.env, session, self.timeout_s)


_SCORERS: dict[int, tuple[Environment, EnvScorer]] = {}


def scorer_for(env: Environment, *, timeout_s: float | None = None) -> EnvScorer:
    """The :class:`EnvScorer` shared by every function built from ``env`` (created on first use, 30 s bound).

    ``timeout_s`` (when given) becomes the bound of that shared scorer's ``reset``/``step``/``close`` calls.
    """
    entry = _SCORERS.get(id(env))
    if entry is None or entry[0] is not env:
        entry = (env, EnvScorer(env))
        _SCORERS[id(env)] = entry
    if timeout_s is not None:
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        entry[1].timeout_s = timeout_s
    return entry[1]


def _completion_text(c: Any) -> str:
    if isinstance(c, str):
        return c
    if isinstance(c, Sequence) and c and isinstance(c[-1], Mapping):  # TRL's [{"role": "assistant", ...}]
        return str(c[-1].get("content") or "")
    raise TypeError(f"a completion must be text or a list of chat messages, got {type(c).__name__}")


def _env_func(
    env: Environment, kind: str, timeout_s: float | None, value: Callable[[StepResult], R]
) -> Callable[..., list[R]]:
    """``(prompts, completions, task_id=[...], **kw) -> [value(step result) per completion]``."""
    scorer = scorer_for(env, timeout_s=timeout_s)
    name = f"env_{kind}_" + re.sub(r"\W+", "_", env.name).strip("_")

    def func(prompts: Sequence[Any], completions: Sequence[Any], task_id: Any = None, **_: Any) -> list[R]:
        if task_id is None:
            raise ValueError(
                f"{name}: the dataset has no `task_id` column; build it with composer_core.envs.env_dataset_rows(env)"
            )
        ids = [str(t) for t in task_id]
        if len(ids) != len(completions):
            raise ValueError(f"{name}: {len(ids)} task ids for {len(completions)} completions")
        return [value(scorer.score(t, _completion_text(c))) for t, c in zip(ids, completions)]

    func.__name__ = func.__qualname__ = name  # TRL logs rewards/<__name__>
    return func


def env_reward_func(env: Environment, *, timeout_s: float | None = None) -> Callable[..., list[float]]:
    """A reward function ``(prompts, completions, task_id=[...], **kw) -> list[float]`` scoring with ``env``."""
    return _env_func(env, "reward", timeout_s, lambda step: float(step.reward))


def env_hint_func(env: Environment, *, timeout_s: float | None = None) -> Callable[..., list[str | None]]:
    """A hint function (composer-trl's ``hint_fn``): the environment's feedback on each completion, or None."""
    return _env_func(
        env, "hint", timeout_s, lambda step: step.feedback if (step.feedback or "").strip() else None
    )


def env_dataset_rows(
    env: Environment, split: str = "train", limit: int | None = None
) -> list[dict[str, Any]]:
    """One row per task (see the module docstring); registers the tasks with the env's :class:`EnvScorer`."""
    tasks = list(env.tasks(split, limit))
    if not tasks:
        raise ValueError(f"environment {env.name!r} has no tasks in split {split!r}")
    scorer_for(env).register(tasks)
    with_ref = any(t.reference is not None for t in tasks)
    with_rejected = any(isinstance(t.info.get("rejected"), str) for t in tasks)
    rows = []
    for t in tasks:
        prompt: Any = t.prompt if isinstance(t.prompt, str) else [m.to_api_dict() for m in t.prompt]
        row: dict[str, Any] = {"prompt": prompt, "task_id": t.task_id}
        if with_ref:
            row["chosen"] = t.reference
        if with_rejected:
            rejected = t.info.get("rejected")
            row["rejected"] = rejected if isinstance(rejected, str) else None
        rows.append(row)
    return rows
