"""Conformance case for the SDPO teacher context built from the group (every adapter's suite runs it).

An adapter passes :func:`check_teacher_context` its own path from a rollout group to the teacher's prompts::

    build(prompts, completions, rewards, group_size, feedback, options) -> (contexts, mask)

with ``options`` a :class:`~composer_core.sdpo.context.TeacherContextOptions` (the adapter maps it onto its own
configuration), ``contexts`` one teacher prompt per row (text or chat messages; anything for masked rows) and
``mask`` the rows that are distilled. The expected values are written out here from the templates, not taken
from :func:`~composer_core.sdpo.context.build_teacher_contexts`, so an adapter calling core is checked too.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from composer_core.sdpo.context import TeacherContextOptions
from composer_core.testing.conformance import ConformanceError

__all__ = ["TEACHER_CONTEXT_CASES", "TeacherContextCase", "check_teacher_context"]

Build = Callable[
    [Sequence[Any], Sequence[str], Sequence[float], int, Sequence[str | None] | None, TeacherContextOptions],
    tuple[Sequence[Any], Sequence[bool]],
]

_R = "Q: {prompt}|{solution}|{feedback}"
_S = "[{demonstration}]"
_F = "<{feedback}>"


@dataclass(frozen=True)
class TeacherContextCase:
    name: str
    options: TeacherContextOptions
    prompts: tuple[Any, ...]
    completions: tuple[str, ...]
    rewards: tuple[float, ...]
    group_size: int
    feedback: tuple[str | None, ...] | None
    contexts: tuple[Any, ...]  # expected; None where masked
    mask: tuple[bool, ...]


def _opts(source: str, **kw: Any) -> TeacherContextOptions:
    return TeacherContextOptions(
        sdpo_teacher_context=source,  # type: ignore[arg-type]
        reprompt_template=_R,
        solution_template=_S,
        feedback_template=_F,
        **kw,
    )


TEACHER_CONTEXT_CASES: tuple[TeacherContextCase, ...] = (
    TeacherContextCase(
        "success: failed rows see the first successful sibling; the success itself is not reprompted",
        _opts("success"),
        ("a", "a", "a", "b", "b", "b"),
        ("x", "ok1", "ok2", "u", "v", "w"),
        (0.0, 1.0, 1.0, 0.0, 0.5, float("nan")),
        3,
        None,
        ("Q: a|[ok1]|", "Q: a|[ok2]|", "Q: a|[ok1]|", None, None, None),
        (True, True, True, False, False, False),
    ),
    TeacherContextCase(
        "success: threshold and a lone success (reprompted on itself only when allowed)",
        _opts("success", success_reward_threshold=0.5, dont_reprompt_on_self_success=False),
        ("a", "a"),
        ("y", "z"),
        (0.5, 0.4),
        2,
        None,
        ("Q: a|[y]|", "Q: a|[y]|"),
        (True, True),
    ),
    TeacherContextCase(
        "success+feedback: both parts; blank feedback is none; thinking removed from the demonstration",
        _opts("success+feedback", remove_thinking_from_demonstration=True),
        ("p", "p", "q", "q"),
        ("<think>hm</think> 42", "41", "1", "2"),
        (1.0, 0.0, 0.0, 0.0),
        2,
        ("", "off by one", "  ", "too big"),
        (None, "Q: p|[42]|<off by one>", None, "Q: q||<too big>"),
        (False, True, False, True),
    ),
    TeacherContextCase(
        "feedback only: no demonstration even where a sibling succeeded",
        _opts("feedback"),
        ("p", "p"),
        ("a", "b"),
        (1.0, 0.0),
        2,
        (None, "wrong"),
        (None, "Q: p||<wrong>"),
        (False, True),
    ),
    TeacherContextCase(
        "chat prompt: earlier messages kept, the last user turn replaced by the reprompt",
        _opts("success"),
        (
            [{"role": "system", "content": "S"}, {"role": "user", "content": "u"}],
            [{"role": "system", "content": "S"}, {"role": "user", "content": "u"}],
        ),
        ("good", "bad"),
        (1.0, 0.0),
        2,
        None,
        (None, [{"role": "system", "content": "S"}, {"role": "user", "content": "Q: u|[good]|"}]),
        (False, True),
    ),
)


def check_teacher_context(build: Build) -> list[str]:
    """Run every case through the adapter's ``build``; returns the passed case names, raises
    :class:`~composer_core.testing.conformance.ConformanceError` listing every mismatch."""
    failures: list[str] = []
    passed: list[str] = []
    for case in TEACHER_CONTEXT_CASES:
        try:
            contexts, mask = build(
                list(case.prompts), list(case.completions), list(case.rewards), case.group_size,
                None if case.feedback is None else list(case.feedback), case.options,
            )  # fmt: skip
        except Exception as exc:
            failures.append(f"[{case.name}] the adapter raised {type(exc).__name__}: {exc}")
            continue
        if [bool(m) for m in mask] != list(case.mask):
            failures.append(f"[{case.name}] mask {list(mask)} != {list(case.mask)}")
            continue
        for i, (got, want) in enumerate(zip(contexts, case.contexts)):
            if want is not None and got != want:
                failures.append(f"[{case.name}] row {i}: teacher context {got!r} != {want!r}")
        passed.append(case.name)
    if failures:
        raise ConformanceError(f"{len(failures)} teacher-context failure(s):\n  " + "\n  ".join(failures))
    return passed
