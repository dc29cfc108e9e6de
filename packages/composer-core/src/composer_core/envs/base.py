"""The environment contract (the README's "Environments" table): tasks, episodes stepped one action at a time
(single-turn hosts: ``reset(task)`` then one ``step(completion)``; multi-turn: ``step`` until ``done``, as
:func:`composer_core.envs.run_episode` does) and :class:`EnvError`, always one line. Pure Python.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from composer_core.traces.schema import Message

__all__ = ["EnvError", "EnvSession", "EnvTask", "Environment", "StepResult", "prompt_messages"]


class EnvError(RuntimeError):
    """An environment faulted (server down, timed out, answered garbage). The message is one line."""

    def __init__(self, message: str) -> None:
        super().__init__(" ".join(str(message).split()))


@dataclass(frozen=True)
class EnvTask:
    """One task of an environment.

    ``prompt`` is text or a chat (a tuple of :class:`~composer_core.traces.schema.Message`); ``tools`` are
    OpenAI tool specs the policy may call; ``reference`` is a correct answer when the environment knows one
    (it becomes channel 3's ``chosen``); ``info`` carries anything else the environment needs to score the
    task (a ``"rejected"`` string there becomes channel 3's ``rejected`` column in
    :func:`composer_core.envs.env_dataset_rows`).
    """

    task_id: str
    prompt: str | tuple[Message, ...]
    tools: tuple[Mapping[str, Any], ...] = ()
    reference: str | None = None
    info: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.task_id, str) or not self.task_id:
            raise ValueError(f"EnvTask.task_id must be a non-empty string, got {self.task_id!r}")
        if isinstance(self.prompt, str):
            if not self.prompt:
                raise ValueError(f"task {self.task_id!r}: the prompt is empty")
        elif (
            not isinstance(self.prompt, tuple)
            or not self.prompt
            or not all(isinstance(m, Message) for m in self.prompt)
        ):
            raise TypeError(f"task {self.task_id!r}: prompt must be a string or a non-empty tuple of Message")
        if self.reference is not None and not isinstance(self.reference, str):
            raise TypeError(f"task {self.task_id!r}: reference must be a string or None")


@dataclass(frozen=True)
class StepResult:
    """What one step of an episode returns.

    ``reward`` is this step's reward (the terminal reward on the last step); ``feedback`` the environment's
    text on what went wrong (None when nothing did), which becomes the channel-2 hint; ``observation`` the next
    user/tool message of a multi-turn episode.
    """

    reward: float
    done: bool
    feedback: str | None = None
    observation: str | None = None
    info: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if isinstance(self.reward, bool) or not isinstance(self.reward, int | float):
            raise TypeError(f"StepResult.reward must be a number, got {type(self.reward).__name__}")
        if self.reward != self.reward:
            raise ValueError("StepResult.reward is NaN")
        if not isinstance(self.done, bool):
            raise TypeError(f"StepResult.done must be a bool, got {type(self.done).__name__}")
        for name in ("feedback", "observation"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, str):
                raise TypeError(f"StepResult.{name} must be a string or None, got {type(value).__name__}")


@runtime_checkable
class EnvSession(Protocol):
    """One episode of an environment: step actions until a result is ``done``, then close."""

    def step(self, action: str) -> StepResult: ...

    def close(self) -> None: ...


@runtime_checkable
class Environment(Protocol):
    """A source of tasks, rewards and feedback (see the module docstring)."""

    name: str

    def tasks(self, split: str = "train", limit: int | None = None) -> Sequence[EnvTask]: ...

    def reset(self, task: EnvTask) -> EnvSession: ...


def prompt_messages(task: EnvTask) -> tuple[Message, ...]:
    """The task's prompt as chat messages (a text prompt is one ``user`` message)."""
    if isinstance(task.prompt, str):
        return (Message("user", task.prompt),)
    return task.prompt
