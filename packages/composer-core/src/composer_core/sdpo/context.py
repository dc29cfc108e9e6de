"""The SDPO teacher's context, built from the group's own rollouts (arXiv 2601.20802, §3).

For each completion ``i`` of a group (the ``G`` completions of one prompt, consecutive in the batch), the
self-teacher reads the prompt *re-asked* with what the group learnt: a successful sibling's answer (reward
≥ ``success_reward_threshold``; never ``i`` itself while ``dont_reprompt_on_self_success``) and/or the
environment's feedback on ``i``; rows with neither get no teacher context (self-distillation mask 0). The
reprompt is three templates (placeholders checked at construction); a chat prompt keeps its earlier messages
and its last (user) message is replaced by the reprompt, as TRL's ``trl.experimental.sdpo.SDPOTrainer`` does.
The options in full: :class:`TeacherContextOptions` and the README's "SDPO teacher context and weights".
"""

from __future__ import annotations

import random
import re
import string
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from composer_core.loss.options import _non_default, _opt
from composer_core.loss.validation import check_bool, check_choice, check_int

__all__ = [
    "CONTEXT_SOURCES",
    "DEFAULT_FEEDBACK_TEMPLATE",
    "DEFAULT_REPROMPT_TEMPLATE",
    "DEFAULT_SOLUTION_TEMPLATE",
    "TeacherContextOptions",
    "TeacherContexts",
    "build_teacher_contexts",
    "cap_reprompt",
    "remove_thinking",
]

ContextSource = Literal["hint", "success", "feedback", "success+feedback"]
CONTEXT_SOURCES: tuple[str, ...] = ("hint", "success", "feedback", "success+feedback")
"""``"hint"``: the user's hint (a ``hint`` column, ``hint_fn``), composer's original path, no group needed;
``"success"``: successful siblings only (no hint, no oracle: the paper's scalar-reward setting);
``"feedback"``: the environment's feedback only; ``"success+feedback"``: both."""

DEFAULT_REPROMPT_TEMPLATE = "{prompt}{solution}{feedback}\n\nAnswer the original question again, correctly.\n"
DEFAULT_SOLUTION_TEMPLATE = "\n\nAn answer to this question that was judged correct:\n\n{demonstration}\n"
DEFAULT_FEEDBACK_TEMPLATE = "\n\nFeedback on an earlier attempt at this question:\n\n{feedback}\n"

_PLACEHOLDERS = {
    "reprompt_template": ("prompt", "solution", "feedback"),
    "solution_template": ("demonstration",),
    "feedback_template": ("feedback",),
}
_THINK = re.compile(r"<think>.*?</think>", flags=re.DOTALL)


def _check_template(name: str, template: object) -> None:
    allowed = _PLACEHOLDERS[name]
    if not isinstance(template, str):
        raise ValueError(f"`{name}` must be a string, got {type(template).__name__}.")
    try:
        fields = [f for _, f, _, _ in string.Formatter().parse(template) if f is not None]
    except ValueError as exc:
        raise ValueError(
            f"`{name}`={template!r} is not a valid format string ({exc}); escape braces as {{{{ }}}}."
        ) from None
    unknown = sorted({f for f in fields if f not in allowed})
    if unknown:
        raise ValueError(
            f"`{name}` has unknown placeholder(s) {', '.join('{' + u + '}' for u in unknown)}; it may use "
            f"{', '.join('{' + a + '}' for a in allowed)} (write literal braces as {{{{ and }}}})."
        )


@dataclass(frozen=True)
class TeacherContextOptions:
    """How the SDPO teacher's context is built (checked once, here). Field names are the flat option names."""

    sdpo_teacher_context: ContextSource = _opt(
        "hint",
        "'hint' (a hint/hinted_prompt column or hint_fn), 'success' (a successful sibling of the group is the demonstration), 'feedback' (hint_fn's text or a privileged_context column) or 'success+feedback'; rows without a teacher context are not distilled.",
    )
    success_reward_threshold: float = _opt(1.0, "the reward at which a completion counts as a success.")
    dont_reprompt_on_self_success: bool = _opt(True, "a successful completion is not its own demonstration.")
    feedback_only_without_solution: bool = _opt(
        False, "'success+feedback': feedback only where no sibling succeeded."
    )
    demo_pick: Literal["first", "random"] = _opt(
        "first", "which successful sibling: 'first' (TRL, lasgroup/SDPO) or 'random' (seeded by seed)."
    )
    reprompt_template: str = _opt(
        DEFAULT_REPROMPT_TEMPLATE, "the teacher's reprompt: {prompt}, {solution}, {feedback}."
    )
    solution_template: str = _opt(
        DEFAULT_SOLUTION_TEMPLATE, "the reprompt's demonstration part: {demonstration}."
    )
    feedback_template: str = _opt(DEFAULT_FEEDBACK_TEMPLATE, "the reprompt's feedback part: {feedback}.")
    max_reprompt_len: int | None = _opt(10240, "keep the last this many tokens of a reprompt.")
    remove_thinking_from_demonstration: bool = _opt(False, "drop <think>...</think> from the demonstration.")

    def __post_init__(self) -> None:
        check_choice("sdpo_teacher_context", self.sdpo_teacher_context, CONTEXT_SOURCES)
        check_choice("demo_pick", self.demo_pick, ("first", "random"))
        threshold = self.success_reward_threshold
        if isinstance(threshold, bool) or not isinstance(threshold, int | float) or threshold != threshold:
            raise ValueError(f"`success_reward_threshold`={threshold!r} must be a number.")
        for name in ("dont_reprompt_on_self_success", "feedback_only_without_solution",
                     "remove_thinking_from_demonstration"):  # fmt: skip
            check_bool(name, getattr(self, name))
        if self.max_reprompt_len is not None:
            check_int("max_reprompt_len", self.max_reprompt_len, low=1)
        for name in _PLACEHOLDERS:
            _check_template(name, getattr(self, name))
        if self.sdpo_teacher_context == "hint":
            changed = [f"`{n}`" for n in _GROUP_ONLY if _non_default(self, n)]
            if changed:
                raise ValueError(
                    f"{', '.join(changed)} only act(s) when the teacher context is built from the group "
                    "(sdpo_teacher_context='success', 'feedback' or 'success+feedback'), but it is 'hint'; "
                    "select one of those or drop the option(s)."
                )
        if self.feedback_only_without_solution and self.sdpo_teacher_context != "success+feedback":
            raise ValueError(
                "`feedback_only_without_solution`=True acts only with sdpo_teacher_context='success+feedback'; "
                "select it or drop the option."
            )

    @property
    def uses_success(self) -> bool:
        return self.sdpo_teacher_context in ("success", "success+feedback")

    @property
    def uses_feedback(self) -> bool:
        return self.sdpo_teacher_context in ("feedback", "success+feedback")

    @property
    def from_group(self) -> bool:
        return self.sdpo_teacher_context != "hint"


_GROUP_ONLY = (
    "success_reward_threshold", "dont_reprompt_on_self_success", "demo_pick", "reprompt_template",
    "solution_template", "feedback_template", "remove_thinking_from_demonstration",
)  # fmt: skip


@dataclass
class TeacherContexts:
    """The output of :func:`build_teacher_contexts` for N rows: per row the teacher's prompt (text or chat
    messages; None where the row has no teacher context), the self-distillation ``mask`` and ``demo_index`` (the
    demonstration's row); counts for logging and the no-success warning."""

    contexts: list[Any | None]
    mask: list[bool]
    demo_index: list[int | None]
    groups: int = 0
    groups_with_success: int = 0
    with_solution: int = 0
    with_feedback: int = 0
    metrics: dict[str, float] = field(default_factory=dict)


def remove_thinking(text: str) -> str:
    """``text`` without its ``<think>…</think>`` blocks (stripped)."""
    return _THINK.sub("", text).strip()


def cap_reprompt(ids: Sequence[int], max_len: int | None) -> list[int]:
    """The last ``max_len`` tokens of a reprompt (all of them for None), as TRL's SDPOTrainer truncates."""
    return list(ids) if max_len is None else list(ids)[-max_len:]


def _reprompt(prompt: Any, solution: str, feedback: str, opts: TeacherContextOptions) -> Any:
    if isinstance(prompt, str):
        return opts.reprompt_template.format(prompt=prompt, solution=solution, feedback=feedback)
    if not isinstance(prompt, list) or not prompt or not isinstance(prompt[-1], dict):
        raise ValueError(f"a prompt must be text or a non-empty chat message list, got {prompt!r:.80}.")
    last = prompt[-1]
    if last.get("role") != "user":
        raise ValueError(
            "the SDPO teacher's reprompt replaces the prompt's last message, which must be a user turn; this "
            f"prompt ends with role {last.get('role')!r} (assistant prefill or tool turn): end prompts with the "
            "user's message or use sdpo_teacher_context='hint'."
        )
    content = last.get("content", "")
    if isinstance(content, list):
        content = " ".join(p.get("text", "") for p in content if p.get("type") == "text")
    text = opts.reprompt_template.format(prompt=content, solution=solution, feedback=feedback)
    return [*prompt[:-1], {"role": "user", "content": text}]


def build_teacher_contexts(
    prompts: Sequence[Any],
    completions: Sequence[str],
    rewards: Sequence[float],
    group_size: int,
    options: TeacherContextOptions,
    *,
    feedback: Sequence[str | None] | None = None,
    seed: int = 0,
) -> TeacherContexts:
    """Each row's SDPO teacher context from its group's successes and/or its feedback (module docstring).

    Args:
        prompts: N prompts (text or chat message lists); rows ``[g·G, (g+1)·G)`` are one group.
        completions: N decoded completions (the demonstrations; special tokens already skipped).
        rewards: N scalar rewards (NaN: never a success).
        group_size: G; N must be a multiple of it.
        options: a :class:`TeacherContextOptions` with a group source (not ``"hint"``).
        feedback: N feedback texts or None (empty or blank text counts as none); needed by the feedback sources.
        seed: seeds ``demo_pick="random"``.
    """
    n = len(prompts)
    if not options.from_group:
        raise ValueError(
            "build_teacher_contexts builds group contexts; sdpo_teacher_context='hint' uses hints."
        )
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1 or n % group_size:
        raise ValueError(f"`group_size`={group_size!r} must be an int >= 1 dividing the {n} rows.")
    if len(completions) != n or len(rewards) != n:
        raise ValueError(
            f"got {n} prompts, {len(completions)} completions and {len(rewards)} rewards; one per row."
        )
    if feedback is not None and len(feedback) != n:
        raise ValueError(f"got {len(feedback)} feedback entries for {n} rows; one per row (None if absent).")
    if options.uses_feedback and feedback is None:
        raise ValueError(
            f"sdpo_teacher_context={options.sdpo_teacher_context!r} needs the environment's feedback per "
            "completion (a hint_fn / feedback source); pass it or use sdpo_teacher_context='success'."
        )
    out = TeacherContexts([None] * n, [False] * n, [None] * n, groups=n // group_size)
    ok = [float(r) >= options.success_reward_threshold for r in rewards]  # NaN >= x is False
    for i in range(n):
        start = (i // group_size) * group_size
        if i == start and any(ok[start : start + group_size]):
            out.groups_with_success += 1
        successful = [
            j
            for j in range(start, start + group_size)
            if options.uses_success and ok[j] and not (options.dont_reprompt_on_self_success and j == i)
        ]
        text = feedback[i] if feedback is not None else None
        has_feedback = isinstance(text, str) and text.strip() != ""
        held_back = options.feedback_only_without_solution and bool(successful)
        use_feedback = options.uses_feedback and has_feedback and not held_back
        solution = ""
        if successful:
            rng = random.Random(seed * 1_000_003 + i // group_size)  # demo_pick="random": seeded per group
            j = successful[0] if options.demo_pick == "first" else rng.choice(successful)
            demo = completions[j]
            if options.remove_thinking_from_demonstration:
                demo = remove_thinking(demo)
            solution = options.solution_template.format(demonstration=demo)
            out.demo_index[i] = j
            out.with_solution += 1
        fb = options.feedback_template.format(feedback=text) if use_feedback else ""
        out.with_feedback += int(use_feedback)
        if successful or use_feedback:
            out.contexts[i] = _reprompt(prompts[i], solution, fb, options)
            out.mask[i] = True
    rows = max(n, 1)
    out.metrics = {
        "success_group_fraction": out.groups_with_success / max(out.groups, 1),
        "success_sample_fraction": out.with_solution / rows,
        "feedback_used_fraction": out.with_feedback / rows,
        "reprompt_sample_fraction": sum(out.mask) / rows,
    }
    return out
