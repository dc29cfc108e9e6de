"""The ``DataProto`` keys composer reads, and how they reach the policy loss.

verl's policy-loss contract carries no teacher log-probs, SDPO masks or preference fields. The composer actor
extension (:mod:`composer_verl.actor`) wraps the worker's loss function so that, for each micro-batch, it reads the
keys below from the micro-batch ``TensorDict`` and makes them visible to the ``composer`` policy loss for the
duration of that call (a context variable: nothing left behind after the call). Their shapes and meaning: the
README's table ("The actor extension and the ``DataProto`` keys it reads").
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

import torch

TEACHER_LOG_PROBS = "composer_teacher_log_probs"
SDPO_MASK = "composer_sdpo_mask"
PREF_PAIR_ID = "composer_pref_pair_id"
PREF_CHOSEN = "composer_pref_chosen"
PREF_REF_LOG_PROB = "composer_pref_ref_log_prob"
REF_LOG_PROB = "ref_log_prob"  # verl's own key
GLOBAL_SDPO_TOKENS = "composer_global_sdpo_tokens"
GLOBAL_PREF_PAIRS = "composer_global_pref_pairs"
TEACHER_PROMPTS = "composer_teacher_prompts"
"""``sdpo_form='topk'``: per row, the teacher context's prompt token ids (jagged int64); the actor re-reads the
response after it inside its training forward."""
SDPO_TOPK_OUTPUT = "composer_sdpo_topk"
"""``sdpo_form='topk'``: the per-token top-k divergence the logits hook returns (a ``model_output`` key of verl)."""
TEACHER_METHOD = "compute_sdpo_teacher_log_prob"
"""The actor worker's method scoring channel 2's teacher contexts with the ``ema``/``base`` teacher's weights."""

TENSOR_KEYS = (TEACHER_LOG_PROBS, SDPO_MASK, PREF_PAIR_ID, PREF_CHOSEN, PREF_REF_LOG_PROB, REF_LOG_PROB)


@dataclass
class ComposerExtras:
    """The composer fields of one micro-batch (``None`` = key absent from the batch)."""

    teacher_log_probs: torch.Tensor | None = None
    sdpo_mask: torch.Tensor | None = None
    pref_pair_id: torch.Tensor | None = None
    pref_chosen: torch.Tensor | None = None
    pref_ref_log_prob: torch.Tensor | None = None
    ref_log_prob: torch.Tensor | None = None
    topk_divergence: torch.Tensor | None = None
    """``sdpo_form='topk'``: (bs, L) per-token divergence from the logits hook (with gradient)."""
    global_sdpo_tokens: float | None = None
    global_pref_pairs: float | None = None
    dp_size: int = 1

    def normalizer(self, global_count: float | None, local: float) -> float:
        """This rank's share of a global count (``global_count / dp_size``), else the local count."""
        return float(local) if global_count is None else float(global_count) / self.dp_size


_ACTIVE: ContextVar[ComposerExtras | None] = ContextVar("composer_verl_extras", default=None)


def active_extras() -> ComposerExtras | None:
    """The extras of the micro-batch whose loss is being computed, or ``None`` outside the extension."""
    return _ACTIVE.get()


@contextlib.contextmanager
def using_extras(extras: ComposerExtras) -> Iterator[None]:
    token = _ACTIVE.set(extras)
    try:
        yield
    finally:
        _ACTIVE.reset(token)


def read_extras(data: Any) -> ComposerExtras:
    """Read composer's keys from a verl micro-batch ``TensorDict`` (padded to ``(bs, L)``)."""
    from verl.utils.tensordict_utils import get_non_tensor_data

    present = [k for k in TENSOR_KEYS if k in data.keys()]  # noqa: SIM118
    tensors: dict[str, torch.Tensor] = {}
    if present:
        selected = data.select(*present)
        if hasattr(selected, "to_padded_tensor"):
            selected = selected.to_padded_tensor()
        tensors = {k: selected[k] for k in present}
    dp_size = get_non_tensor_data(data, "dp_size", None)
    return ComposerExtras(
        teacher_log_probs=tensors.get(TEACHER_LOG_PROBS),
        sdpo_mask=tensors.get(SDPO_MASK),
        pref_pair_id=tensors.get(PREF_PAIR_ID),
        pref_chosen=tensors.get(PREF_CHOSEN),
        pref_ref_log_prob=tensors.get(PREF_REF_LOG_PROB),
        ref_log_prob=tensors.get(REF_LOG_PROB),
        global_sdpo_tokens=get_non_tensor_data(data, GLOBAL_SDPO_TOKENS, None),
        global_pref_pairs=get_non_tensor_data(data, GLOBAL_PREF_PAIRS, None),
        dp_size=int(dp_size) if dp_size is not None else 1,
    )


def with_composer_batch(
    loss_fn: Callable[..., Any], logits_processor: Callable[[Any, Any], dict[str, Any]] | None = None
) -> Callable[..., Any]:
    """Wrap a verl worker loss function (``ppo_loss`` or ``distillation_ppo_loss`` partial, signature
    ``(model_output, data, dp_group=None)``): ``loss_fn`` runs unchanged while the micro-batch's composer keys are
    visible to the ``composer`` policy loss (verl's own terms and metrics stay verl's). verl's engine also calls the
    worker loss as its logits hook (``loss_fn(student_logits=, data=)`` with ``distillation_use_topk``): that call
    goes to ``logits_processor``, whose per-token ``SDPO_TOPK_OUTPUT`` reaches the loss with the other keys.
    """

    def composer_batch_loss(*args: Any, **kwargs: Any) -> Any:
        data = kwargs["data"] if "data" in kwargs else args[1]
        if "student_logits" in kwargs and logits_processor is not None:  # verl's logits hook (see actor.py)
            return logits_processor(kwargs["student_logits"], data)
        extras = read_extras(data)
        model_output = kwargs["model_output"] if "model_output" in kwargs else (args[0] if args else None)
        if isinstance(model_output, dict) and SDPO_TOPK_OUTPUT in model_output:
            from verl.workers.utils.padding import no_padding_2_padding

            extras.topk_divergence = no_padding_2_padding(model_output[SDPO_TOPK_OUTPUT], data)
        with using_extras(extras):
            return loss_fn(*args, **kwargs)

    composer_batch_loss.__wrapped__ = loss_fn  # type: ignore[attr-defined]
    return composer_batch_loss
