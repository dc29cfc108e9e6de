"""The inputs and the output of :func:`~composer_core.loss.compose.compose_loss`: :class:`ComposerBatch` (every
tensor one call may use, by channel) and :class:`ComposeResult`."""

from __future__ import annotations

from dataclasses import dataclass, field, fields

from torch import Tensor

from composer_core.loss.metrics import Metrics

__all__ = ["ComposeResult", "ComposerBatch"]


@dataclass
class ComposerBatch:
    """All tensors one ``compose_loss`` call may use. B sequences, T completion tokens, V vocabulary,
    H hidden size, P preference pairs. Masks are bool or 0/1.

    Channel 1 (policy, required):
        logprobs: [B, T] log-prob of each sampled completion token under the current policy (with grad).
        advantages: [B] or [B, T].
        completion_mask: [B, T] tokens that count for the policy loss.
        old_logprobs: [B, T] sampling-time policy log-probs (None → ratio 1).
        ref_logprobs: [B, T] reference-model log-probs (for ``kl_beta != 0``).
        inference_logprobs: [B, T] inference-engine log-probs (for ``rollout_correction``).
        rollout_is_weights: [B, T] (or [B, 1]) precomputed detached rollout IS weights.
        surrogate_mask: [B, T] or [B, 1] tokens whose surrogate counts (e.g. TRL's entropy / off-policy masks).

    Channel 2 (SDPO; any one form, plus ``sdpo_mask``):
        sdpo_mask: [B, T] tokens to distil (e.g. the targeted span, 0 for samples without a hint);
            None → ``completion_mask``.
        full form: student_logits [B, T, V] (grad), teacher_logits [B, T, V] (the hinted context; detached).
        fused form: student_hidden [B, T, Hs] (grad), teacher_hidden [B, T, Ht] (detached),
            lm_head_weight [V, Hs] (grad), lm_head_bias [V] (optional); teacher_lm_head_weight [V, Ht] /
            teacher_lm_head_bias [V] (optional, detached: a teacher with weights of its own, e.g. an EMA
            teacher or a model of another hidden size Ht; None → the student's head, which needs Ht = Hs).
        sampled form: teacher_logprobs [B, T] (the student side is ``logprobs``).

    Channel 3 (trace replay):
        chosen_logps / rejected_logps: [P] summed completion log-probs under the policy (grad).
        ref_chosen_logps / ref_rejected_logps: [P] summed reference log-probs (DPO only).
        chosen_lengths / rejected_lengths: [P] completion token counts (SimPO, IPO).
    """

    logprobs: Tensor
    advantages: Tensor
    completion_mask: Tensor
    old_logprobs: Tensor | None = None
    ref_logprobs: Tensor | None = None
    inference_logprobs: Tensor | None = None
    rollout_is_weights: Tensor | None = None
    surrogate_mask: Tensor | None = None
    sdpo_mask: Tensor | None = None
    student_logits: Tensor | None = None
    teacher_logits: Tensor | None = None
    student_hidden: Tensor | None = None
    teacher_hidden: Tensor | None = None
    lm_head_weight: Tensor | None = None
    lm_head_bias: Tensor | None = None
    teacher_lm_head_weight: Tensor | None = None
    teacher_lm_head_bias: Tensor | None = None
    teacher_logprobs: Tensor | None = None
    chosen_logps: Tensor | None = None
    rejected_logps: Tensor | None = None
    ref_chosen_logps: Tensor | None = None
    ref_rejected_logps: Tensor | None = None
    chosen_lengths: Tensor | None = None
    rejected_lengths: Tensor | None = None


@dataclass
class ComposeResult:
    """Output of :func:`compose_loss`.

    total: scalar to backpropagate. policy / sdpo / replay: the channel-1 / 2 / 3 losses (before w_policy / α / β;
    None when the channel was skipped: policy only with ``w_policy=0``). metrics: a :class:`~composer_core.loss.metrics.Metrics`
    mapping (keys: :data:`~composer_core.loss.metrics.METRIC_KEYS`): reading it gives floats (all keys converted
    with one host transfer, on first read), ``metrics.tensors()`` gives the detached 0-dim tensors unread.
    ``float(v)`` / ``dict(metrics)`` keep working.
    """

    total: Tensor
    policy: Tensor | None
    sdpo: Tensor | None = None
    replay: Tensor | None = None
    metrics: Metrics = field(default_factory=Metrics)


def _present(batch: ComposerBatch, *names: str) -> list[str]:
    return [n for n in names if getattr(batch, n) is not None]


_BATCH_FIELDS = tuple(f.name for f in fields(ComposerBatch))
