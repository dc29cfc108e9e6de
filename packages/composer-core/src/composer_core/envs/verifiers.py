"""verifiers environments (``composer-core[verifiers]``, verifiers >= 0.4) behind composer's environment contract.

The mapping, the episode flow and what raises instead of being skipped: the README's "Environments: verifiers".
composer is the policy and no LLM endpoint is ever called.
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import AsyncIterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from typing import Any

from composer_core.traces.schema import Message, message_from_dict

from .base import EnvError, EnvTask, StepResult

__all__ = ["VerifiersEnvironment"]

_EXTRA = "verifiers is not installed: pip install 'composer-core[verifiers]' (verifiers >= 0.4)"


def _vf() -> Any:
    try:
        import verifiers.v1 as vf
    except ImportError as e:  # pragma: no cover - exercised only without the extra
        raise ImportError(_EXTRA) from e
    return vf


class VerifiersEnvironment:
    """An installed verifiers environment (``module``) as a composer :class:`~composer_core.envs.base.Environment`.

    ``taskset_args`` are fields of the taskset's config (e.g. ``num_tasks``), ``env_args`` fields of the env's
    config (multi-turn envs, e.g. ``max_attempts``); both validated by verifiers' pydantic configs here.
    ``timeout_s`` bounds every scoring call and every advance of a multi-turn ``run``.
    """

    def __init__(
        self,
        module: str,
        *,
        taskset_args: Mapping[str, Any] | None = None,
        env_args: Mapping[str, Any] | None = None,
        feedback_key: str = "feedback",
        timeout_s: float = 30.0,
    ) -> None:
        if not module or not isinstance(module, str):
            raise ValueError(f"module={module!r}: name an installed verifiers env (verifiers:<module>)")
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        vf = _vf()
        from verifiers.v1.utils import loaders

        self.name = f"verifiers:{module}"
        self.module = module
        self.feedback_key = feedback_key
        self.timeout_s = float(timeout_s)
        try:
            env_cls = loaders.environment_class(module)
            config_cls = loaders.taskset_config_type(module)
        except (ModuleNotFoundError, TypeError, AttributeError, ValueError) as e:
            raise ValueError(f"--env verifiers:{module}: {e}") from None
        ts_config = config_cls(id=module, **dict(taskset_args or {}))
        self.multi_turn = env_cls is not vf.SingleAgentEnv
        self.vf_env: Any = None
        if self.multi_turn:
            env_config = loaders.resolve_env_config(
                {"taskset": ts_config.model_dump(), **dict(env_args or {})}
            )
            self.vf_env = env_cls(env_config)
            from verifiers.v1.configs.agent import agent_config_fields

            self.seats = list(agent_config_fields(env_config))
            if len(self.seats) != 1:
                raise ValueError(
                    f"{self.name}: its Env declares seats {self.seats}; composer drives exactly one (the policy) "
                    "and never calls an LLM for the others"
                )
            self.taskset = self.vf_env.taskset
        else:
            if env_args:
                raise ValueError(
                    f"{self.name} is single-turn (no Env of its own): env_args={dict(env_args)} unused"
                )
            self.seats = []
            self.taskset = loaders.load_taskset(ts_config)
        self._tasks: dict[str, Any] = {}

    # --- Environment -----------------------------------------------------------------------------------------

    def tasks(self, split: str = "train", limit: int | None = None) -> Sequence[EnvTask]:
        """The taskset's tasks (``load()`` order), at most ``limit``. A verifiers taskset has one task stream:
        ``split`` must be ``"train"`` (pick another stream with ``taskset_args``, e.g. a seed)."""
        if split != "train":
            raise ValueError(
                f"{self.name}: split={split!r}: a verifiers taskset has one task stream ('train'); "
                "load another stream through taskset_args (e.g. a different seed)"
            )
        if limit is not None and limit < 1:
            raise ValueError(f"limit must be >= 1 or None, got {limit}")
        view = self.taskset if limit is None else self.taskset.take(limit)
        if not view.bounded:
            raise ValueError(f"{self.name}: the taskset is infinite; pass limit")
        pairs = [(self._to_env_task(task), task) for task in view]
        self._tasks.update((env_task.task_id, task) for env_task, task in pairs)
        return [env_task for env_task, _ in pairs]

    def task(self, task_id: str) -> EnvTask:
        """The task with id ``task_id`` (composer_core.envs.trl_funcs looks rows up through this)."""
        if task_id not in self._tasks and self.taskset.bounded:
            self.tasks()
        if task_id not in self._tasks:
            raise ValueError(f"{self.name}: unknown task_id {task_id!r}")
        return self._to_env_task(self._tasks[task_id])

    def reset(self, task: EnvTask) -> _SingleTurnSession | _MultiTurnSession:
        vf_task = self._tasks.get(task.task_id)
        if vf_task is None:
            raise EnvError(f"{self.name}: unknown task_id {task.task_id!r} (use this env's tasks())")
        self._check_offline(vf_task)
        if self.multi_turn:
            return _MultiTurnSession(self, vf_task, self.seats[0])
        return _SingleTurnSession(self, vf_task)

    def trace_feedback(self, trace: Any) -> str | None:
        """The feedback of this env's rewards on a finished verifiers ``Trace`` (e.g. one PRIME-RL's orchestrator
        holds): a copy of the trace is scored by the task's own rewards, the original is left untouched."""
        task_cls = type(self.taskset).task_type()
        task = task_cls(trace.task.data, self.taskset.config.task)
        self._check_offline(task)
        copy = trace.model_copy(deep=True)
        copy.info.pop(self.feedback_key, None)
        return self._score(task, copy).feedback

    # --- helpers ---------------------------------------------------------------------------------------------

    def _to_env_task(self, task: Any) -> EnvTask:
        data = task.data
        task_id = str(data.id) if data.id else f"{self.module}-{data.idx}"
        answer = getattr(data, "answer", None)
        own = set(type(data).model_fields) - set(_vf().TaskData.model_fields) - {"answer"}
        extra = data.model_dump(mode="json", include=own)  # the env's own task fields, e.g. "rejected"
        info = {**extra, "vf_key": task.key, "vf_idx": data.idx}
        return EnvTask(
            task_id, _prompt(data), reference=answer if isinstance(answer, str) else None, info=info
        )

    def _check_offline(self, task: Any) -> None:
        judges = task.plugged_judges()
        if judges:
            names = [j.reward_name for j in judges]
            raise EnvError(f"{self.name} scores with LLM judges {names}; composer calls no LLM endpoint")
        for fn in task.hooks("reward"):
            param = inspect.signature(fn).parameters.get("runtime")
            if param is not None and param.default is inspect.Parameter.empty:
                raise EnvError(
                    f"{self.name}: reward {fn.__name__!r} needs a runtime (sandbox); composer scores offline"
                )

    def _run(self, coro: Any) -> Any:
        """Run one coroutine to completion, bounded by ``timeout_s``."""

        async def bounded() -> Any:
            return await asyncio.wait_for(coro, self.timeout_s)

        try:
            try:
                asyncio.get_running_loop()
            except RuntimeError:  # no loop here: run on this thread
                return asyncio.run(bounded())
            with ThreadPoolExecutor(1) as pool:  # called from async code (an orchestrator): a loop of its own
                return pool.submit(asyncio.run, bounded()).result()
        except TimeoutError:
            raise EnvError(f"{self.name}: scoring exceeded timeout_s={self.timeout_s:g}s") from None

    def _score(self, task: Any, trace: Any) -> StepResult:
        """The task's own scoring of ``trace`` -> the terminal :class:`StepResult`."""
        try:
            self._run(task.score(trace))
        except EnvError:
            raise
        except Exception as e:
            raise EnvError(f"{self.name}: scoring failed: {type(e).__name__}: {e}") from None
        return self._terminal(trace)

    def _terminal(self, trace: Any) -> StepResult:
        rewards = {k: (None if r is None else r.score) for k, r in trace.rewards.items()}
        if any(v is None for v in rewards.values()):
            raise EnvError(f"{self.name}: scoring left rewards unscored: {rewards}")
        feedback = trace.info.get(self.feedback_key)
        if feedback is not None and not isinstance(feedback, str):
            raise EnvError(
                f"{self.name}: trace.info[{self.feedback_key!r}] is {type(feedback).__name__}, not text"
            )
        return StepResult(float(trace.reward), True, feedback or None, info={"rewards": rewards})


def _prompt(data: Any) -> str | tuple[Message, ...]:
    prompt = data.prompt
    if prompt is None:
        raise ValueError(f"verifiers task {data.id or data.idx}: no prompt (the user opens; not supported)")
    if isinstance(prompt, str) and not data.system_prompt:
        return prompt
    msgs = [Message("system", data.system_prompt)] if data.system_prompt else []
    if isinstance(prompt, str):
        msgs.append(Message("user", prompt))
    else:
        msgs += [message_from_dict(m.model_dump(exclude_none=True), f"task {data.idx}") for m in prompt]
    return tuple(msgs)


def _new_trace(task: Any, seat: str = "agent") -> Any:
    """A verifiers ``Trace`` for ``task`` holding its prompt messages (system prompt first)."""
    vf = _vf()
    from verifiers.v1.trace import AgentInfo

    trace = vf.Trace(task=_trace_task(task), agent=AgentInfo(config=vf.AgentConfig(), name=seat))
    data = task.data
    msgs: list[Any] = [vf.SystemMessage(content=data.system_prompt)] if data.system_prompt else []
    msgs += [vf.UserMessage(content=data.prompt)] if isinstance(data.prompt, str) else list(data.prompt or [])
    for m in msgs:
        _append(trace, m, sampled=False)
    return trace


def _trace_task(task: Any) -> Any:
    from verifiers.v1.trace import TraceTask

    return TraceTask(type=type(task).__name__, data=task.data, key=task.key, hash=task.hash)


def _append(trace: Any, message: Any, *, sampled: bool) -> None:
    from verifiers.v1.graph import MessageNode

    parent = len(trace.nodes) - 1 if trace.nodes else None
    trace.nodes.append(MessageNode(parent=parent, message=message, sampled=sampled))


class _SingleTurnSession:
    """One completion scored by the task's rewards."""

    def __init__(self, env: VerifiersEnvironment, task: Any) -> None:
        self.env, self.task, self.done = env, task, False

    def step(self, action: str) -> StepResult:
        if self.done:
            raise EnvError(f"{self.env.name}: the episode is over (single-turn); reset for a new one")
        self.done = True
        trace = _new_trace(self.task)
        _append(trace, _vf().AssistantMessage(content=action), sampled=True)
        return self.env._score(self.task, trace)

    def close(self) -> None:
        self.done = True


class _Bridge:
    """The solver seat, played by composer: ``turn`` waits for the action ``step`` hands in."""

    def __init__(self, seat: str, task: Any) -> None:
        self.seat, self.task = seat, task
        self.trace = _new_trace(task, seat)
        self.requests: asyncio.Queue[str | None] = asyncio.Queue()
        self.action: asyncio.Future[str] | None = None
        self.opened = False
        self.trainable = True

    @asynccontextmanager
    async def interaction(self, task: Any) -> AsyncIterator[_Bridge]:
        if self.opened:
            raise RuntimeError("composer's solver seat supports one interaction per episode")
        self.opened = True
        yield self

    async def turn(self, message: Any = None) -> Any:
        vf = _vf()
        if message is not None:
            text = (
                message
                if isinstance(message, str)
                else "\n\n".join(vf.content_text(m.content) for m in message)
            )
            _append(self.trace, vf.UserMessage(content=text), sampled=False)
        self.action = asyncio.get_running_loop().create_future()
        await self.requests.put(None if message is None else text)
        action = await self.action
        reply = vf.AssistantMessage(content=action)
        _append(self.trace, reply, sampled=True)
        from verifiers.v1.agent import Segment

        return Segment(messages=[reply])


class _Agents:
    def __init__(self, bridge: _Bridge) -> None:
        self._bridge = bridge

    def __getattr__(self, name: str) -> _Bridge:
        if name != self._bridge.seat:
            raise AttributeError(
                f"this env's only seat is {self._bridge.seat!r} (composer plays it), not {name!r}"
            )
        return self._bridge


class _MultiTurnSession:
    """The env's own ``run`` on a private event loop, advanced one policy action per ``step``."""

    def __init__(self, env: VerifiersEnvironment, task: Any, seat: str) -> None:
        self.env, self.task = env, task
        self.run: asyncio.Task[Any] | None = None
        self.done = False
        self.loop = asyncio.new_event_loop()
        self.bridge = _Bridge(seat, task)
        agents = _Agents(self.bridge)
        try:
            self.loop.run_until_complete(self._bounded(env.vf_env.setup(agents)))
        except Exception as e:
            self.close()
            raise e if isinstance(e, EnvError) else EnvError(f"{env.name}: setup() failed: {e!r}") from None
        self.run = self.loop.create_task(env.vf_env.run(task, agents))
        if self._advance() is _DONE:
            error = self.run.exception()
            self.close()
            why = f" (it raised {error!r})" if error is not None else ""
            raise EnvError(f"{env.name}: its run() ended without asking the policy for a reply{why}")

    async def _bounded(self, coro: Any) -> Any:
        try:
            return await asyncio.wait_for(coro, self.env.timeout_s)
        except TimeoutError:
            raise EnvError(
                f"{self.env.name}: run() did not advance within timeout_s={self.env.timeout_s:g}s"
            ) from None

    async def _next(self) -> Any:
        """The env's next message to the policy, or ``_DONE`` once ``run`` has returned."""
        assert self.run is not None
        get = asyncio.ensure_future(self.bridge.requests.get())
        try:
            await asyncio.wait({get, self.run}, return_when=asyncio.FIRST_COMPLETED)
            return get.result() if get.done() else _DONE
        finally:
            if not get.done():  # finished here, not left pending on a loop that is about to close
                get.cancel()
                await asyncio.gather(get, return_exceptions=True)

    def _advance(self) -> Any:
        try:
            return self.loop.run_until_complete(self._bounded(self._next()))
        except EnvError:
            self.close()
            raise

    def step(self, action: str) -> StepResult:
        if self.done:
            raise EnvError(f"{self.env.name}: the episode is over; reset for a new one")
        assert self.bridge.action is not None
        self.bridge.action.set_result(action)
        message = self._advance()
        if message is not _DONE:
            return StepResult(0.0, False, feedback=message or None)
        self.done = True
        assert self.run is not None
        try:
            self.run.result()
        except Exception as e:
            self.close()
            raise EnvError(f"{self.env.name}: run() failed: {type(e).__name__}: {e}") from None
        return self._finish()

    def _finish(self) -> StepResult:
        trace = self.bridge.trace
        try:
            self.loop.run_until_complete(self._bounded(self.task.score(trace)))
            if type(self.env.vf_env).finalize is not _vf().Env.finalize:
                episode = _vf().Episode(task=_trace_task(self.task), traces=[trace])
                self.loop.run_until_complete(self._bounded(self.env.vf_env.finalize(self.task, episode)))
        except EnvError:
            raise
        except Exception as e:
            raise EnvError(f"{self.env.name}: scoring failed: {type(e).__name__}: {e}") from None
        finally:
            self.close()
        return self.env._terminal(trace)

    def close(self) -> None:
        self.done = True
        if self.loop.is_closed():
            return
        if self.run is not None and not self.run.done():
            self.run.cancel()
            self.loop.run_until_complete(asyncio.gather(self.run, return_exceptions=True))
        self.loop.close()


_DONE = object()
