"""SDPO as its authors run it, shared by every adapter: the teacher's context built from the group's own
successes and feedback (:mod:`.context`) and the teacher's weights, live / frozen base / EMA (:mod:`.teacher`).
The divergence itself is channel 2 of :func:`composer_core.loss.compose.compose_loss`. The public names are
those of the two modules' ``__all__``."""

from composer_core.sdpo import context, teacher
from composer_core.sdpo.context import *  # noqa: F403
from composer_core.sdpo.teacher import *  # noqa: F403

__all__ = [*context.__all__, *teacher.__all__]
