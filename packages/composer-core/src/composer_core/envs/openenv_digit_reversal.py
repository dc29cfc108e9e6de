"""The embedded digit-reversal task served as an OpenEnv environment (OpenEnv's own server classes).

How to run it: the README's "Environments". It is :class:`composer_core.envs.digit_reversal.DigitReversalEnv`
behind OpenEnv's :class:`HTTPEnvServer`: one :class:`DigitReversalOpenEnv` per WebSocket session,
``reset(split=..., index=..., max_attempts=...)`` starts the episode of that task (``max_attempts`` > 1 makes
it multi-turn, default ``--max-attempts``), ``step(DigitReversalAction(answer=...))`` returns a
:class:`DigitReversalObservation` with the reward (``verify``), ``done`` and the ``feedback`` (the
task's hint, ``".8.|"``). The environment also implements OpenEnv's Task API (``list_splits``,
``num_tasks``, ``get_task``, ``get_task_range``, ``list_tasks``): each task spec is
``{"id", "index", "split", "prompt", "reference", "rejected"}``, which is how
:class:`composer_core.envs.openenv.OpenEnvEnvironment` learns the prompts and the reference answers.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from typing import Any

if __name__ == "__main__":
    # This process serves no Gradio web UI; OpenEnv imports gradio only if it is importable (its documented
    # fallback when gradio is absent), and skipping it starts the server in a third of the time.
    sys.modules.setdefault("gradio", None)  # type: ignore[arg-type]

from fastapi import FastAPI
from openenv.core.env_server import Action, Environment, HTTPEnvServer, Observation, State

from .base import EnvTask
from .digit_reversal import SPLIT_SEEDS, DigitReversalEnv, DigitReversalSession

__all__ = [
    "ENV_NAME",
    "DigitReversalAction",
    "DigitReversalObservation",
    "DigitReversalOpenEnv",
    "build_app",
    "main",
]

ENV_NAME = "digit_reversal"


class DigitReversalAction(Action):
    """The policy's answer (the digits reversed)."""

    answer: str


class DigitReversalObservation(Observation):
    """The prompt (at reset), the verifier's feedback (after a wrong answer) and the attempt count."""

    prompt: str = ""
    task_id: str = ""
    feedback: str | None = None
    attempt: int = 0


def _spec(split: str, index: int, task: EnvTask) -> dict[str, Any]:
    return {
        "id": task.task_id,
        "index": index,
        "split": split,
        "prompt": task.prompt,
        "reference": task.reference,
        "rejected": task.info.get("rejected"),
    }


class DigitReversalOpenEnv(Environment[DigitReversalAction, DigitReversalObservation, State]):
    """One session of the digit-reversal task (see the module docstring)."""

    SUPPORTS_CONCURRENT_SESSIONS = True
    config: DigitReversalEnv = DigitReversalEnv()

    def __init__(self) -> None:
        super().__init__()
        self._session: DigitReversalSession | None = None
        self._state = State(episode_id=None, step_count=0)

    # --- episodes ---------------------------------------------------------------------------
    def reset(
        self,
        seed: int | None = None,
        episode_id: str | None = None,
        split: str = "train",
        index: int = 0,
        max_attempts: int | None = None,
        **kwargs: Any,
    ) -> DigitReversalObservation:
        task = self._task(split, index)
        env = self.config if max_attempts is None else replace(self.config, max_attempts=int(max_attempts))
        self._session = env.reset(task)
        self._state = State(episode_id=episode_id or task.task_id, step_count=0)
        assert isinstance(task.prompt, str)
        return DigitReversalObservation(prompt=task.prompt, task_id=task.task_id, reward=None, done=False)

    def step(
        self, action: DigitReversalAction, timeout_s: float | None = None, **kwargs: Any
    ) -> DigitReversalObservation:
        if self._session is None:
            raise RuntimeError("step before reset: call reset(split=..., index=...) first")
        result = self._session.step(action.answer)
        self._state = State(episode_id=self._state.episode_id, step_count=self._state.step_count + 1)
        return DigitReversalObservation(
            prompt=self._session.prompt,
            feedback=result.feedback,
            attempt=int(result.info["attempt"]),
            reward=result.reward,
            done=result.done,
        )

    @property
    def state(self) -> State:
        return self._state

    # --- OpenEnv's Task API -----------------------------------------------------------------
    def _task(self, split: str, index: int) -> EnvTask:
        tasks = self.config.tasks(split)
        if not 0 <= index < len(tasks):
            raise IndexError(f"task index {index} out of range for split {split!r} ({len(tasks)} tasks)")
        return tasks[index]

    def list_splits(self) -> list[str]:
        return list(SPLIT_SEEDS)

    def num_tasks(self, split: str) -> int:
        return len(self.config.tasks(split))

    def get_task(self, split: str, index: int) -> dict[str, Any]:
        return _spec(split, index, self._task(split, index))

    def get_task_range(
        self, split: str, start: int | None = None, stop: int | None = None
    ) -> list[dict[str, Any]]:
        tasks = self.config.tasks(split)
        lo, hi, _ = slice(start, stop).indices(len(tasks))
        return [_spec(split, i, tasks[i]) for i in range(lo, hi)]

    def list_tasks(self, split: str) -> list[dict[str, Any]]:
        return self.get_task_range(split)


def build_app(*, max_concurrent_envs: int = 64, **env: Any) -> FastAPI:
    """The FastAPI app: OpenEnv's :class:`HTTPEnvServer` routes for :class:`DigitReversalOpenEnv` serving
    ``DigitReversalEnv(**env)`` (``n_tasks``, ``min_digits``, ``max_digits``, ``seed``, ``max_attempts``)."""
    env_cls = type("DigitReversalOpenEnv", (DigitReversalOpenEnv,), {"config": DigitReversalEnv(**env)})
    app = FastAPI(title="composer digit-reversal (OpenEnv)")
    server = HTTPEnvServer(
        env_cls,
        DigitReversalAction,
        DigitReversalObservation,
        max_concurrent_envs=max_concurrent_envs,
        env_name=ENV_NAME,
    )
    server.register_routes(app, mode="simulation")
    return app


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(
        prog="python -m composer_core.envs.openenv_digit_reversal", description=__doc__.split("\n")[0]
    )
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    defaults = DigitReversalEnv()
    for name in ("n_tasks", "min_digits", "max_digits", "seed", "max_attempts"):
        p.add_argument(f"--{name.replace('_', '-')}", type=int, default=getattr(defaults, name))
    kw = vars(p.parse_args(argv))
    host, port = kw.pop("host"), kw.pop("port")
    import uvicorn

    uvicorn.run(build_app(**kw), host=host, port=port, log_level="warning")


if __name__ == "__main__":
    main()
