"""OpenEnv adapter (``composer-core[openenv]``): ``load_env("openenv:http://host:port")`` gives an
:class:`OpenEnvEnvironment` (one OpenEnv ``GenericEnvClient`` session per episode). The mapping, the seeded
fallback (``reset(seed=SPLIT_SEEDS[split] + i)``) and the faults: the README's "Environments".
"""

from __future__ import annotations

import contextlib
import importlib
import json
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar
from urllib.parse import urlsplit, urlunsplit

from composer_core.traces.schema import Message, message_from_dict

from .base import EnvError, EnvTask, StepResult
from .digit_reversal import SPLIT_SEEDS  # also the seed offsets of the seeded-episode fallback

__all__ = ["SPLIT_SEEDS", "OpenEnvEnvironment", "OpenEnvSession"]

T = TypeVar("T")
_MAX_MSG = 300


def _import(module: str) -> Any:
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise ImportError(
            f"--env openenv:<url> needs OpenEnv ({e}); install it with: pip install 'composer-core[openenv]'"
        ) from e


def redact_url(url: str) -> str:
    """``url`` without its user/password part."""
    parts = urlsplit(url)
    if parts.username is None and parts.password is None:
        return url
    host = parts.hostname or ""
    netloc = f"***@{host}" + (f":{parts.port}" if parts.port else "")
    return urlunsplit((parts.scheme, netloc, parts.path, parts.query, parts.fragment))


class OpenEnvEnvironment:
    """An OpenEnv server at ``url`` (see the module docstring for the mapping and the faults)."""

    def __init__(
        self,
        url: str,
        *,
        timeout_s: float = 30.0,
        env_name: str | None = None,
        action_field: str | None = None,
        prompt_field: str = "prompt",
        feedback_field: str = "feedback",
        observation_field: str | None = None,
        reset_kwargs: Mapping[str, Any] | None = None,
    ) -> None:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https", "ws", "wss") or not parts.hostname:
            raise ValueError(
                f"--env openenv:{redact_url(url)}: expected an http(s):// or ws(s):// URL of an OpenEnv server, "
                "e.g. openenv:http://127.0.0.1:8000"
            )
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        self._client_cls = _import("openenv.core.generic_client").GenericEnvClient
        self._httpx = _import("httpx")
        self.url = url.rstrip("/")
        self.http_url = urlunsplit(
            (parts.scheme.replace("ws", "http"), parts.netloc, parts.path, "", "")
        ).rstrip("/")
        self.name = f"openenv:{redact_url(self.url)}"
        self.timeout_s = timeout_s
        self._env_name, self._action_field = env_name, action_field
        self.prompt_field, self.feedback_field = prompt_field, feedback_field
        self.observation_field = observation_field
        self.reset_kwargs = dict(reset_kwargs or {})
        self._tasks: dict[str, EnvTask] = {}

    # --- errors -----------------------------------------------------------------------------
    def fail(self, message: str) -> EnvError:
        text = f"{self.name}: {message}"
        return EnvError(text if len(text) <= _MAX_MSG else text[: _MAX_MSG - 3] + "...")

    def guard(self, what: str, fn: Callable[[], T]) -> T:
        """``fn()`` with every fault turned into one-line :class:`EnvError`."""
        try:
            return fn()
        except EnvError:
            raise
        except (TimeoutError, self._httpx.TimeoutException) as e:  # asyncio's TimeoutError too (3.11+)
            raise self.fail(f"{what} did not answer within timeout_s={self.timeout_s:g}s") from e
        except (ConnectionError, self._httpx.ConnectError) as e:
            raise self.fail(f"{what}: cannot connect ({e}); is the OpenEnv server running?") from e
        except json.JSONDecodeError as e:
            raise self.fail(f"{what} answered non-JSON ({e.msg}); is this an OpenEnv server?") from e
        except Exception as e:
            raise self.fail(f"{what} failed: {type(e).__name__}: {e}") from e

    # --- HTTP (Task API, schema) ------------------------------------------------------------
    def _http(self, method: str, path: str, body: Mapping[str, Any] | None = None) -> tuple[int, Any]:
        def call() -> tuple[int, Any]:
            with self._httpx.Client(base_url=self.http_url, timeout=self.timeout_s, trust_env=False) as c:
                r = c.request(method, path, json=body)
            if r.status_code == 501:
                return 501, None
            if r.status_code >= 400:
                raise self.fail(f"{method} {path} answered HTTP {r.status_code}: {r.text[:120]}")
            return r.status_code, json.loads(r.text)

        return self.guard(f"{method} {path}", call)

    @property
    def env_name(self) -> str:
        """The server's environment name (``GET /list_environments``), unless given."""
        if self._env_name is None:
            _, names = self._http("GET", "/list_environments")
            if not isinstance(names, list) or len(names) != 1 or not isinstance(names[0], str):
                raise self.fail(f"/list_environments answered {str(names)[:80]!r}; pass env_name=...")
            self._env_name = names[0]
        return self._env_name

    @property
    def action_field(self) -> str:
        """The action's text field: the one string property of the server's action schema, unless given."""
        if self._action_field is None:
            _, schema = self._http("GET", "/schema")
            props = schema.get("action", {}).get("properties", {}) if isinstance(schema, dict) else {}
            text = [k for k, v in props.items() if isinstance(v, dict) and v.get("type") == "string"]
            if len(text) != 1:
                raise self.fail(
                    f"cannot tell the action's text field from /schema (string fields {text}); pass action_field=..."
                )
            self._action_field = text[0]
        return self._action_field

    # --- tasks ------------------------------------------------------------------------------
    def tasks(self, split: str = "train", limit: int | None = None) -> Sequence[EnvTask]:
        body: dict[str, Any] = {"split": split, "start": 0, "stop": limit}
        status, payload = self._http("POST", f"/{self.env_name}/task_range", body)
        if status == 501:
            out = self._seeded_tasks(split, 16 if limit is None else limit)
        else:
            specs = payload.get("tasks") if isinstance(payload, dict) else None
            if not isinstance(specs, list):
                raise self.fail(f"task_range answered {str(payload)[:80]!r} (expected {{'tasks': [...]}})")
            out = [self._task_from_spec(split, i, s) for i, s in enumerate(specs)]
        self._tasks.update((t.task_id, t) for t in out)
        return out

    def task(self, task_id: str) -> EnvTask:
        """A task seen by :meth:`tasks` (the scorer's lookup)."""
        if task_id not in self._tasks:
            raise ValueError(f"task_id {task_id!r} was not listed by {self.name}; call tasks() first")
        return self._tasks[task_id]

    def _task_from_spec(self, split: str, i: int, spec: Any) -> EnvTask:
        if not isinstance(spec, dict):
            raise self.fail(f"task spec {i} of split {split!r} is {type(spec).__name__}, not an object")
        index = spec.get("index", i)
        prompt = self._prompt(spec.get(self.prompt_field), f"task spec {i} of split {split!r}")
        ref = next((spec[k] for k in ("reference", "answer") if isinstance(spec.get(k), str)), None)
        info: dict[str, Any] = {"reset": {"split": split, "index": index}, "spec": spec}
        if isinstance(spec.get("rejected"), str):
            info["rejected"] = spec["rejected"]
        return EnvTask(str(spec.get("id", f"{split}-{index}")), prompt, reference=ref, info=info)

    def _seeded_tasks(self, split: str, n: int) -> list[EnvTask]:
        if split not in SPLIT_SEEDS:
            raise ValueError(
                f"{self.name} has no Task API; seeded splits are {sorted(SPLIT_SEEDS)}, not {split!r}"
            )
        out = []
        for i in range(n):
            seed = SPLIT_SEEDS[split] + i
            session = OpenEnvSession(self, {**self.reset_kwargs, "seed": seed})
            session.close()
            prompt = self._prompt(session.first.get(self.prompt_field), f"reset(seed={seed})")
            out.append(EnvTask(f"{split}-seed-{seed}", prompt, info={"reset": {"seed": seed}}))
        return out

    def _prompt(self, value: Any, where: str) -> str | tuple[Message, ...]:
        if isinstance(value, str) and value:
            return value
        if isinstance(value, list) and value:
            try:
                return tuple(message_from_dict(m, f"{where}.{self.prompt_field}") for m in value)
            except ValueError as e:
                raise self.fail(str(e)) from e
        raise self.fail(f"{where} has no {self.prompt_field!r} (text or chat); pass prompt_field=...")

    # --- episodes ---------------------------------------------------------------------------
    def reset(self, task: EnvTask) -> OpenEnvSession:
        return OpenEnvSession(self, {**self.reset_kwargs, **task.info.get("reset", {})})

    def observation(self, result: Any, what: str) -> dict[str, Any]:
        """The observation dict of OpenEnv's ``StepResult``, or a one-line EnvError."""
        obs = getattr(result, "observation", None)
        if not isinstance(obs, dict):
            raise self.fail(
                f"{what} answered a malformed observation ({type(obs).__name__}, expected an object)"
            )
        return obs

    def parse(self, result: Any, what: str) -> StepResult:
        """OpenEnv's ``StepResult`` (observation dict, reward, done) -> composer's, or a one-line EnvError."""
        obs = self.observation(result, what)
        reward, done = getattr(result, "reward", None), getattr(result, "done", None)
        if reward is not None and (isinstance(reward, str) or not isinstance(reward, int | float)):
            raise self.fail(f"{what} answered a malformed reward {reward!r} (expected a number)")
        if not isinstance(done, bool):
            raise self.fail(f"{what} answered a malformed done {done!r} (expected true/false)")
        feedback = obs.get(self.feedback_field)
        text = obs.get(self.observation_field) if self.observation_field else None
        for field, value in ((self.feedback_field, feedback), (self.observation_field, text)):
            if value is not None and not isinstance(value, str):
                raise self.fail(
                    f"{what} answered a malformed {field!r} ({type(value).__name__}, expected text)"
                )
        info = {"observation": obs, "metadata": getattr(result, "metadata", None) or {}}
        return StepResult(0.0 if reward is None else float(reward), done, feedback, text, info)


class OpenEnvSession:
    """One episode: an OpenEnv client session (its own WebSocket) reset with ``reset_kwargs``."""

    def __init__(self, env: OpenEnvEnvironment, reset_kwargs: Mapping[str, Any]) -> None:
        self.env = env
        t = env.timeout_s
        self.client = env._client_cls(base_url=env.url, connect_timeout_s=t, message_timeout_s=t).sync()
        try:
            env.guard("connect", self.client.connect)
            first = env.guard("reset", lambda: self.client.reset(**reset_kwargs))
            self.first: dict[str, Any] = env.observation(first, "reset")
        except BaseException:
            self.close()
            raise

    def step(self, action: str) -> StepResult:
        field = self.env.action_field
        return self.env.parse(self.env.guard("step", lambda: self.client.step({field: action})), "step")

    def close(self) -> None:
        # closing a dead session must not mask the episode's own error
        with contextlib.suppress(Exception):
            self.client.close()
