"""Episodes of an environment: run them, find their error sites, turn them into training records.

Message layout of an :class:`EnvEpisode` (built by :func:`episode_from_steps`, which every adapter uses)::

    prompt messages (the task's prompt; a text prompt is one user message)
    for each step k:  assistant  = the policy's action k
                      user       = the environment's reply to it: feedback, then observation (joined by a
                                   blank line); only when the step returned either
    a failed episode may end with one more assistant action whose step faulted (no reply)

``EnvEpisode.reward`` is the **sum** of the step rewards; error sites, hints and records: the README's
"Environments" table.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import queue
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal, TypeVar

from composer_core.traces.hints import HintSource, build_hinted_context
from composer_core.traces.records import TraceRecord, validate_record
from composer_core.traces.schema import Episode, ErrorSite, Message

from .base import EnvError, Environment, EnvSession, EnvTask, StepResult, prompt_messages

__all__ = [
    "EnvEpisode",
    "episode_error_sites",
    "episode_from_steps",
    "episode_records",
    "feedback_hint",
    "run_episode",
]

T = TypeVar("T")
_COUNTER = itertools.count()


@dataclass(frozen=True)
class EnvEpisode:
    """One episode of an environment: the task, the chat (actions and replies), the step results, the return.

    ``failed`` is the one-line reason when the environment faulted (the episode is kept, not raised).
    """

    task: EnvTask
    episode: Episode
    steps: tuple[StepResult, ...]
    reward: float
    failed: str | None = None


def _chat(task: EnvTask, actions: Sequence[str], steps: Sequence[StepResult]) -> tuple[Message, ...]:
    """The episode's messages in the layout of the module docstring."""
    messages = list(prompt_messages(task))
    for k, action in enumerate(actions):
        messages.append(Message("assistant", action))
        reply = [p for p in (steps[k].feedback, steps[k].observation) if p] if k < len(steps) else []
        if reply:
            messages.append(Message("user", "\n\n".join(reply)))
    return tuple(messages)


def episode_from_steps(
    task: EnvTask,
    actions: Sequence[str],
    steps: Sequence[StepResult],
    *,
    env_name: str,
    failed: str | None = None,
    episode_id: str | None = None,
) -> EnvEpisode:
    """Build an :class:`EnvEpisode` in the layout of the module docstring.

    ``actions`` has one entry per step, or one more when the last action's step faulted (then ``failed``
    must say why).
    """
    if not len(steps) <= len(actions) <= len(steps) + 1:
        raise ValueError(f"{len(actions)} actions for {len(steps)} steps (need as many, or one more)")
    if len(actions) > len(steps) and failed is None:
        raise ValueError("an action without a step result needs `failed` (why the step did not complete)")
    messages = _chat(task, actions, steps)
    eid = episode_id or f"{env_name}:{task.task_id}:{next(_COUNTER)}"
    meta = {"env": env_name, "task_id": task.task_id, **({"failed": failed} if failed else {})}
    episode = Episode(eid, messages, task.tools, meta)
    reward = float(sum(s.reward for s in steps))
    return EnvEpisode(task, episode, tuple(steps), reward, failed)


def _step_turns(ep: EnvEpisode) -> list[tuple[int, int | None]]:
    """``(action index, reply index or None)`` per action (the layout of the module docstring)."""
    msgs = ep.episode.messages
    replied = [i + 1 < len(msgs) and msgs[i + 1].role == "user" for i in range(len(msgs))]
    start = len(prompt_messages(ep.task))
    return [
        (i, i + 1 if replied[i] else None) for i in range(start, len(msgs)) if msgs[i].role == "assistant"
    ]


def _call_bounded(fn: Callable[[], T], timeout_s: float, what: str) -> T:
    """``fn()`` in a daemon thread; EnvError when it takes longer than ``timeout_s`` (the thread is abandoned)."""
    box: queue.Queue[tuple[bool, object]] = queue.Queue(maxsize=1)

    def target() -> None:
        try:
            box.put((True, fn()))
        except BaseException as e:
            box.put((False, e))

    threading.Thread(target=target, daemon=True, name=f"env-{what}").start()
    try:
        ok, value = box.get(timeout=timeout_s)
    except queue.Empty:
        raise EnvError(f"{what} did not answer within timeout_s={timeout_s:g}s") from None
    if not ok:
        assert isinstance(value, BaseException)
        raise value
    return value  # type: ignore[return-value]


def run_episode(
    env: Environment,
    task: EnvTask,
    act: Callable[[Sequence[Message]], str],
    max_turns: int = 8,
    timeout_s: float = 30.0,
    *,
    episode_id: str | None = None,
) -> EnvEpisode:
    """Play one episode: ``act(messages so far)`` gives each action, the environment steps it.

    Stops when a step is ``done`` or after ``max_turns`` actions. ``reset`` and every ``step`` are bounded by
    ``timeout_s``; an :class:`EnvError` (or a timeout) ends the episode as a failed one (``failed`` = the
    one-line reason) instead of raising. Errors of ``act`` itself propagate.
    """
    if max_turns < 1:
        raise ValueError(f"max_turns must be >= 1, got {max_turns}")
    if not timeout_s > 0:
        raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
    actions: list[str] = []
    steps: list[StepResult] = []
    failed: str | None = None
    session: EnvSession | None = None
    try:
        session = _call_bounded(lambda: env.reset(task), timeout_s, f"{env.name} reset")
        for _ in range(max_turns):
            action = act(_chat(task, actions, steps))
            if not isinstance(action, str):
                raise TypeError(f"act returned {type(action).__name__}, expected the action text (str)")
            actions.append(action)
            steps.append(_bounded_step(env, session, action, timeout_s))
            if steps[-1].done:
                break
    except EnvError as e:
        failed = str(e)
    finally:
        if session is not None:
            _close_quietly(env, session, timeout_s)
    return episode_from_steps(task, actions, steps, env_name=env.name, failed=failed, episode_id=episode_id)


def _bounded_step(env: Environment, session: EnvSession, action: str, timeout_s: float) -> StepResult:
    """``session.step(action)`` bounded by ``timeout_s``; EnvError when it answers anything but a StepResult."""
    step = _call_bounded(functools.partial(session.step, action), timeout_s, f"{env.name} step")
    if not isinstance(step, StepResult):
        raise EnvError(f"{env.name}: step returned {type(step).__name__}, not a StepResult")
    return step


def _close_quietly(env: Environment, session: EnvSession, timeout_s: float) -> None:
    """Close ``session``; the episode's result (or error) is already what matters, so a close fault is dropped."""
    with contextlib.suppress(EnvError):
        _call_bounded(session.close, timeout_s, f"{env.name} close")


def episode_error_sites(ep: EnvEpisode) -> list[ErrorSite]:
    """The environment's replies that carry feedback, as error sites (see the module docstring)."""
    env = str(ep.episode.metadata.get("env", "env"))
    return [
        ErrorSite(ep.episode.id, reply, action, f"step-{k}", env, ("env_feedback",), feedback)
        for k, (action, reply) in enumerate(_step_turns(ep))
        if reply is not None and (feedback := ep.steps[k].feedback) and feedback.strip()
    ]


def feedback_hint(ep_or_feedback: EnvEpisode | str | None = None) -> HintSource:
    """A hint source whose hint is the environment's feedback.

    ``None``: the feedback an env error site carries (its ``evidence``); an :class:`EnvEpisode`: the feedback of
    that episode's step at the site's action; a string: that text at every site.
    """
    if isinstance(ep_or_feedback, str):
        text = ep_or_feedback
        if not text.strip():
            raise ValueError("feedback_hint: the feedback text is empty (an empty hint distils nothing)")
        return lambda episode, site: text
    if isinstance(ep_or_feedback, EnvEpisode):
        by_action = {s.action_turn: s.evidence for s in episode_error_sites(ep_or_feedback)}

        def from_episode(episode: Episode, site: ErrorSite) -> str:
            if site.action_turn not in by_action:
                raise ValueError(f"no environment feedback at action {site.action_turn} of {episode.id!r}")
            return by_action[site.action_turn]

        return from_episode
    if ep_or_feedback is not None:
        raise TypeError(
            f"feedback_hint takes an EnvEpisode, str or None, got {type(ep_or_feedback).__name__}"
        )

    def from_site(episode: Episode, site: ErrorSite) -> str:
        if "env_feedback" not in site.kinds:
            raise ValueError(f"site {site.episode_id}@{site.turn} is not an environment-feedback site")
        return site.evidence

    return from_site


def episode_records(
    ep: EnvEpisode, *, hint_role: Literal["user", "system"] = "user", pairs: bool = True
) -> list[TraceRecord]:
    """Training records of one episode (the :mod:`composer_core.traces.records` schema).

    One record per scored action that has feedback (channel 2: the hint is the feedback, inserted as a
    ``hint_role`` message before the action) and/or, when ``pairs`` and the task has a reference answer that
    differs from the action, channel 3 (``chosen`` = the reference, ``rejected`` = the action). The unscored
    last action of a failed episode gets no record.
    """
    sites = {s.action_turn: s for s in episode_error_sites(ep)}
    hint = feedback_hint()
    msgs, ref = ep.episode.messages, ep.task.reference
    out = []
    for k, (a, _) in enumerate(_step_turns(ep)[: len(ep.steps)]):  # the unscored last action: no record
        action = msgs[a]
        row: dict[str, object] = {
            "id": f"{ep.episode.id}@{a}",
            "episode_id": ep.episode.id,
            "turn": a,
            "prompt": [m.to_dict() for m in msgs[:a]],
            "completion": [action.to_dict()],
            "tools": [dict(t) for t in ep.episode.tools],
        }
        site = sites.get(a)
        if site is not None:
            ctx = build_hinted_context(ep.episode, site, hint, role=hint_role)
            row |= {
                "teacher_prompt": [m.to_dict() for m in ctx.teacher_prompt],
                "hint": ctx.hint,
                "hint_index": ctx.hint_index,
                "error_kinds": list(site.kinds),
            }
        if pairs and ref is not None and " ".join(ref.split()) != " ".join(action.text.split()):
            row |= {
                "chosen": [Message("assistant", ref).to_dict()],
                "rejected": [action.to_dict()],
                "chosen_by": "verifier",
                "chosen_teachers": [f"env:{ep.episode.metadata.get('env', 'env')}"],
            }
        if site is not None or "chosen" in row:
            out.append(validate_record(row, f"episode {ep.episode.id} action {k}"))
    return out
