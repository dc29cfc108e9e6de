"""SDPO as its authors run it, shared by every adapter: the teacher's context built from the group's own
successes and feedback (:mod:`.context`) and the teacher's weights, live / frozen base / EMA (:mod:`.teacher`).
The divergence itself is channel 2 of :func:`composer_core.loss.compose.compose_loss`."""

from composer_core.sdpo.context import (
    CONTEXT_SOURCES,
    DEFAULT_FEEDBACK_TEMPLATE,
    DEFAULT_REPROMPT_TEMPLATE,
    DEFAULT_SOLUTION_TEMPLATE,
    TeacherContextOptions,
    TeacherContexts,
    build_teacher_contexts,
    cap_reprompt,
    remove_thinking,
)
from composer_core.sdpo.teacher import (
    TEACHER_KINDS,
    TEACHER_STATE_FILE,
    TeacherWeightsOptions,
    ema_update_,
    ema_update_tensors_,
    frozen_copy,
    load_teacher,
    save_teacher,
)

__all__ = [
    "CONTEXT_SOURCES",
    "DEFAULT_FEEDBACK_TEMPLATE",
    "DEFAULT_REPROMPT_TEMPLATE",
    "DEFAULT_SOLUTION_TEMPLATE",
    "TEACHER_KINDS",
    "TEACHER_STATE_FILE",
    "TeacherContextOptions",
    "TeacherContexts",
    "TeacherWeightsOptions",
    "build_teacher_contexts",
    "cap_reprompt",
    "ema_update_",
    "ema_update_tensors_",
    "frozen_copy",
    "load_teacher",
    "remove_thinking",
    "save_teacher",
]
