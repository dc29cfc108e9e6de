"""SDPO's teacher context built from the group (successful siblings and/or feedback) for the driver.

Rows are decoded with ``task.text``, given composer-core's
:func:`~composer_core.sdpo.context.build_teacher_contexts`, and encoded with ``task.encode`` (else
composer-core's character vocabulary); contexts differ in length, so the teacher scores each on its own.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from composer_core.sdpo.context import TeacherContextOptions, build_teacher_contexts, cap_reprompt
from composer_core.tasks import digit_reversal as rules
from torch import Tensor

from composer_monarch.rollout import Rollout

__all__ = ["rollout_teacher_contexts", "text_teacher_contexts"]


def text_teacher_contexts(
    prompts: Sequence[Any],
    completions: Sequence[str],
    rewards: Sequence[float],
    group_size: int,
    feedback: Sequence[str | None] | None,
    options: TeacherContextOptions,
    seed: int = 0,
) -> tuple[list[Any], list[bool]]:
    """Each row's teacher context (text) and whether it is distilled (core's ``build_teacher_contexts``)."""
    built = build_teacher_contexts(
        prompts, completions, rewards, group_size, options,
        feedback=feedback if options.uses_feedback else None, seed=seed,
    )  # fmt: skip
    return list(built.contexts), list(built.mask)


def rollout_teacher_contexts(
    task: Any, rollout: Rollout, rewards: Tensor, options: TeacherContextOptions, seed: int = 0
) -> tuple[list[Tensor], Tensor]:
    """(one context's token ids per row, distilled rows [n] bool) for a rollout; a masked row's context is its
    own prompt (never scored into the loss). A context keeps its last ``max_reprompt_len`` tokens (core's
    ``cap_reprompt``, as TRL's SDPOTrainer cuts it)."""
    mask_t = rollout.completion_mask.bool()
    prompts = [task.text(p) for p in rollout.prompt_ids]
    completions = [task.text(c[m]) for c, m in zip(rollout.completion_ids, mask_t, strict=True)]
    feedback = None
    if options.uses_feedback:
        fb = getattr(task, "feedback", None)
        if not callable(fb):
            raise ValueError(
                f"sdpo_teacher_context={options.sdpo_teacher_context!r} needs the task's feedback: give the task a "
                "feedback(prompt_ids, completion_ids) -> str | None method or use sdpo_teacher_context='success'."
            )
        feedback = [
            fb(p, c[m]) for p, c, m in zip(rollout.prompt_ids, rollout.completion_ids, mask_t, strict=True)
        ]
    contexts, mask = text_teacher_contexts(
        prompts, completions, [float(r) for r in rewards], rollout.group_size, feedback, options, seed
    )
    encode: Callable[[str], list[int]] = getattr(task, "encode", rules.encode)
    ids: list[Tensor] = []
    for i, (ctx, keep) in enumerate(zip(contexts, mask, strict=True)):
        if not keep:
            ids.append(rollout.prompt_ids[i].long())
            continue
        try:
            ids.append(torch.tensor(cap_reprompt(encode(ctx), options.max_reprompt_len), dtype=torch.long))
        except ValueError as e:
            raise ValueError(
                f"the teacher context of row {i} cannot be tokenised by the task ({e}); write reprompt_template / "
                "solution_template / feedback_template in the task's vocabulary."
            ) from e
    return ids, torch.tensor(mask, dtype=torch.bool)
