"""GRPO-family policy loss: clipped surrogate, KL penalty, aggregation, rollout-mismatch corrections.

References: GRPO (DeepSeekMath, arXiv 2402.03300); PPO clipping (Schulman et al., arXiv 1707.06347); DAPO
clip-higher and token-level loss (arXiv 2503.14476); Dr. GRPO (arXiv 2503.20783); INTELLECT-2 two-sided
``delta`` clip (arXiv 2505.07291); truncated IS (Yao et al. 2025, "Your efficient RL framework secretly
brings you off-policy RL training"); masked IS / IcePop (arXiv 2510.18855); DPPO probability-difference
masking (arXiv 2602.04879) as PRIME-RL's default loss; KL estimators k1/k2/k3 (Schulman, "Approximating KL
divergence", 2020).

The op order of :func:`policy_loss` follows TRL 1.16 ``GRPOTrainer._compute_loss`` exactly
(ratio → clip → min → × rollout IS weight → + β·KL → aggregate) so a TRL adapter reproduces it bit-exactly.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from composer_core.loss.metrics import Metrics
from composer_core.loss.options import (
    CLIP_LOSS_TYPES,
    LOSS_TYPES,
    ROLLOUT_MODES,
    KLEstimator,
    LossType,
    PolicyOptions,
    RolloutMode,
    check_clip_args,
    check_rollout_clip,
)
from composer_core.loss.surrogates import (
    cispo_surrogate,
    log_importance_weights,
    sapo_surrogate,
    vespo_weights,
)
from composer_core.loss.validation import (
    as_mask,
    check_choice,
    check_float,
    check_int,
    check_normalizer,
    check_probability,
    check_same_shape,
)

__all__ = [
    "CLIP_LOSS_TYPES",
    "PolicyLossOutput",
    "aggregate_loss",
    "clipped_surrogate",
    "clipped_surrogate_from_ratio",
    "dppo_loss",
    "dppo_mask",
    "kl_penalty",
    "policy_loss",
    "rollout_correction_weights",
]

#: ``policy_loss``'s options when none are given (frozen: one shared instance)
_DEFAULT_OPTIONS = PolicyOptions()


def _broadcast_advantages(advantages: Tensor, like: Tensor) -> Tensor:
    """[B] → [B, 1] (TRL's conditional unsqueeze); [B, 1] and [B, T] unchanged; anything else raises."""
    check_float("advantages", advantages)
    if advantages.dim() == 1:
        if advantages.shape[0] != like.shape[0]:
            raise ValueError(
                f"`advantages` has {advantages.shape[0]} entries but `logprobs` has batch size {like.shape[0]}."
            )
        return advantages.unsqueeze(1)
    if advantages.dim() == 2 and advantages.shape[1] == 1 and advantages.shape[0] == like.shape[0]:
        return advantages
    if advantages.shape != like.shape:
        raise ValueError(
            f"`advantages` must be [B] or [B, T] = {tuple(like.shape)}, got {tuple(advantages.shape)}."
        )
    return advantages


def kl_penalty(
    logprobs: Tensor, ref_logprobs: Tensor, estimator: KLEstimator = PolicyOptions.kl_estimator
) -> Tensor:
    """Per-token KL(πθ‖πref) estimate on the sampled token (Schulman 2020), ``x = ℓref − ℓθ``.

    ``k1 = ℓθ − ℓref``; ``k2 = ½x²``; ``k3 = eˣ − x − 1`` (DeepSeekMath, TRL when ``beta≠0``, verl
    ``low_var_kl`` without its clamps). Gradient flows through ``logprobs`` only.
    """
    check_float("logprobs", logprobs)
    check_float("ref_logprobs", ref_logprobs)
    check_same_shape("logprobs", logprobs, "ref_logprobs", ref_logprobs)
    check_choice("estimator", estimator, ("k1", "k2", "k3"))
    return _kl_unchecked(logprobs, ref_logprobs.detach(), estimator)


def _kl_unchecked(logprobs: Tensor, ref: Tensor, estimator: str) -> Tensor:
    if estimator == "k1":
        return logprobs - ref
    if estimator == "k2":
        x = ref - logprobs
        return 0.5 * x * x
    # Same expression (and op order) as TRL 1.16 GRPOTrainer._compute_loss.
    return torch.exp(ref - logprobs) - (ref - logprobs) - 1


def clipped_surrogate(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    *,
    epsilon_low: float = PolicyOptions.epsilon_low,
    epsilon_high: float | None = PolicyOptions.epsilon_high,
    delta: float | None = PolicyOptions.delta,
) -> tuple[Tensor, Tensor]:
    """PPO/GRPO clipped surrogate per token, with DAPO clip-higher and INTELLECT-2 two-sided ``delta``.

    ``ρ = exp(ℓθ − ℓold)``, ``L_t = −min(min(ρ, δ)·A, clip(ρ, 1−ε_lo, 1+ε_hi)·A)``.

    Returns ``(per_token_loss [B, T], is_clipped [B, T] bool)``, where ``is_clipped`` marks tokens whose
    gradient is cut by the clip region (``ρ < 1−ε_lo ∧ A < 0`` or ``ρ > 1+ε_hi ∧ A > 0``, TRL's
    ``clip_ratio/region_mean``). ``advantages`` is [B] or [B, T].
    """
    check_float("logprobs", logprobs)
    check_float("old_logprobs", old_logprobs)
    check_same_shape("logprobs", logprobs, "old_logprobs", old_logprobs)
    adv = _broadcast_advantages(advantages, logprobs)
    eps_lo, eps_hi = check_clip_args(epsilon_low, epsilon_high, delta)
    coef_1 = torch.exp(logprobs - old_logprobs.detach())
    return clipped_surrogate_from_ratio(coef_1, adv, eps_lo, eps_hi, delta)


def clipped_surrogate_from_ratio(
    coef_1: Tensor, adv: Tensor, eps_lo: float, eps_hi: float, delta: float | None
) -> tuple[Tensor, Tensor]:
    """:func:`clipped_surrogate` given the importance ratio ρ itself (TRL 1.16's op order), for a caller holding
    another ratio (e.g. against the inference engine's log-probs) that checked its inputs: nothing is validated.

    ``L_t = −min(min(ρ, δ)·A, clip(ρ, 1−ε_lo, 1+ε_hi)·A)`` (``delta=None``: no ``min(ρ, δ)``), ``is_clipped =
    (ρ' < 1−ε_lo ∧ A < 0) ∨ (ρ' > 1+ε_hi ∧ A > 0)`` with ``ρ' = min(ρ, δ)``. Shapes: ``coef_1`` any (e.g. [B, T],
    [B, 1]); ``adv`` broadcastable to it; returns ``(per_token_loss, is_clipped)`` of the broadcast shape.
    """
    coef_2 = torch.clamp(coef_1, 1 - eps_lo, 1 + eps_hi)
    if delta is not None:
        coef_1 = torch.clamp(coef_1, max=delta)
    per_token_loss1 = coef_1 * adv
    per_token_loss2 = coef_2 * adv
    per_token_loss = -torch.min(per_token_loss1, per_token_loss2)
    with torch.no_grad():
        is_clipped = ((coef_1 < 1 - eps_lo) & (adv < 0)) | ((coef_1 > 1 + eps_hi) & (adv > 0))
    return per_token_loss, is_clipped.expand_as(per_token_loss)


def aggregate_loss(
    per_token_loss: Tensor,
    mask: Tensor,
    loss_type: LossType,
    *,
    normalizer: float | Tensor | None = None,
    max_completion_length: int | None = PolicyOptions.max_completion_length,
) -> Tensor:
    """Reduce a [B, T] per-token loss to a scalar (TRL ``loss_type`` / verl ``loss_agg_mode``).

    - ``grpo``, ``sapo``: ``mean_i(Σ_t L·m / Σ_t m)`` (GRPO paper); with ``normalizer`` (global number of
      sequences): ``Σ_i(...) / normalizer``.
    - ``luspo``: ``mean_i(Σ_t L·m)`` (a per-sequence sum; ``normalizer`` as for ``grpo``).
    - ``bnpo``: ``Σ L·m / Σ m`` over the local micro-batch; ``normalizer`` is rejected.
    - ``dr_grpo``: ``Σ L·m / (B·L_max)`` (Dr. GRPO, arXiv 2503.20783), ``L_max = max_completion_length``
      (default T); ``normalizer`` replaces ``B·L_max``.
    - ``dapo``, ``cispo``, ``vespo``: ``Σ L·m / normalizer`` with ``normalizer`` = global active-token count (DAPO token-level
      loss); ``None`` → local ``Σ m``.

    Passing the global count over all micro-batches and ranks makes gradient accumulation exact: the
    sum of micro-batch losses equals the full-batch loss. Denominators are clamped to ≥ 1.
    """
    check_float("per_token_loss", per_token_loss, ndim=2)
    check_choice("loss_type", loss_type, LOSS_TYPES)
    m_bool = as_mask("mask", mask, per_token_loss.shape, device=per_token_loss.device, require_nonempty=False)
    m = mask if (mask.dtype != torch.bool and mask.is_floating_point()) else m_bool.to(per_token_loss.dtype)
    check_normalizer("normalizer", normalizer)
    if max_completion_length is not None:
        if loss_type != "dr_grpo":
            raise ValueError(
                f"`max_completion_length` is only used by loss_type='dr_grpo', not {loss_type!r}."
            )
        check_int("max_completion_length", max_completion_length, low=1)
    return _aggregate(per_token_loss, m, loss_type, normalizer, max_completion_length)


def _aggregate(
    per_token_loss: Tensor,
    m: Tensor,
    loss_type: str,
    normalizer: float | Tensor | None,
    max_completion_length: int | None,
) -> Tensor:
    """:func:`aggregate_loss` on validated inputs (``m`` a float mask in the loss dtype)."""
    if loss_type in ("grpo", "sapo", "luspo"):
        per_seq = (per_token_loss * m).sum(-1)
        if loss_type != "luspo":  # luspo: a per-sequence sum
            per_seq = per_seq / m.sum(-1).clamp(min=1.0)
        return per_seq.mean() if normalizer is None else per_seq.sum() / normalizer
    if loss_type == "bnpo":
        if normalizer is not None:
            raise ValueError(
                "loss_type='bnpo' normalises by the local token count by definition; drop `normalizer` or "
                "use loss_type='dapo' for a global token count."
            )
        return (per_token_loss * m).sum() / m.sum().clamp(min=1.0)
    if loss_type == "dr_grpo" and normalizer is not None and max_completion_length is not None:
        raise ValueError(
            "loss_type='dr_grpo': pass either `normalizer` (global B·L_max) or `max_completion_length`, not both."
        )
    if loss_type == "dr_grpo" and normalizer is None:
        l_max = per_token_loss.shape[1] if max_completion_length is None else max_completion_length
        if l_max < per_token_loss.shape[1]:
            raise ValueError(
                f"`max_completion_length`={l_max} is shorter than the completion width T="
                f"{per_token_loss.shape[1]}; pass the generation cap (>= T)."
            )
        return (per_token_loss * m).sum() / (per_token_loss.size(0) * l_max)
    denom = m.sum().clamp(min=1.0) if normalizer is None else normalizer
    return (per_token_loss * m).sum() / denom


def rollout_correction_weights(
    logprobs: Tensor,
    inference_logprobs: Tensor,
    mask: Tensor,
    *,
    mode: RolloutMode,
    clip_max: float | None = PolicyOptions.rollout_clip_max,
    clip_min: float | None = PolicyOptions.rollout_clip_min,
) -> Tensor:
    """Detached importance weights ``π_train/π_inference`` correcting trainer/inference mismatch [B, T].

    ``δ = (ℓtrain − ℓinf)·m``; token modes use ``ρ_t = e^{δ_t}``, sequence modes ``ρ = e^{Σ_t δ_t}`` broadcast
    over the sequence (TRL ``vllm_importance_sampling_mode``).

    - ``*_truncate`` (TIS, Yao et al. 2025): ``clamp(ρ, clip_min, clip_max)``.
    - ``*_mask`` (MIS / IcePop, arXiv 2510.18855): ``ρ·1[clip_min ≤ ρ ≤ clip_max]`` (dropped, not clipped).

    ``logprobs`` should be the trainer's log-probs at sampling time (``old_logprobs``; TRL uses them).
    """
    check_float("logprobs", logprobs)
    check_float("inference_logprobs", inference_logprobs)
    check_same_shape("logprobs", logprobs, "inference_logprobs", inference_logprobs)
    check_choice("mode", mode, ROLLOUT_MODES)
    m_bool = as_mask("mask", mask, logprobs.shape, device=logprobs.device, require_nonempty=False)
    check_rollout_clip(clip_min, clip_max)
    return _rollout_weights(logprobs, inference_logprobs, m_bool, mode, clip_max, clip_min)


def _rollout_weights(
    logprobs: Tensor,
    inference_logprobs: Tensor,
    m_bool: Tensor,
    mode: str,
    clip_max: float | None,
    clip_min: float | None,
) -> Tensor:
    """:func:`rollout_correction_weights` on validated inputs."""
    with torch.no_grad():
        m = m_bool.to(logprobs.dtype)
        diff = (logprobs.detach() - inference_logprobs.detach()) * m
        if mode.startswith("sequence"):
            diff = diff.sum(dim=-1, keepdim=True)
        ratio = torch.exp(diff)
        if mode.endswith("truncate"):
            ratio = torch.clamp(ratio, min=clip_min, max=clip_max)
        else:
            lo = -float("inf") if clip_min is None else float(clip_min)
            hi = float("inf") if clip_max is None else float(clip_max)
            ratio = ratio.masked_fill((ratio < lo) | (ratio > hi), 0.0)
        return ratio.expand_as(logprobs)


def dppo_mask(
    logprobs: Tensor,
    inference_logprobs: Tensor,
    advantages: Tensor,
    *,
    mask_low: float = PolicyOptions.dppo_mask_low,
    mask_high: float = PolicyOptions.dppo_mask_high,
) -> Tensor:
    """PRIME-RL DPPO-Binary-TV trust-region mask (DPPO, arXiv 2602.04879) [B, T], True = masked out.

    ``Δp = exp(ℓtrain) − exp(ℓinf)``; ``masked = (A > 0 ∧ Δp > mask_high) ∨ (A ≤ 0 ∧ Δp < −mask_low)``:
    bounds are on probabilities, not log-ratios, and depend on the advantage sign.
    """
    adv = _check_dppo(logprobs, inference_logprobs, advantages, mask_low, mask_high)
    return _dppo_mask(logprobs, inference_logprobs, adv, mask_low, mask_high)


def _check_dppo(
    logprobs: Tensor, inference_logprobs: Tensor, advantages: Tensor, mask_low: float, mask_high: float
) -> Tensor:
    """The checks of :func:`dppo_mask` / :func:`dppo_loss`; returns the advantages broadcast to [B, 1|T]."""
    check_float("logprobs", logprobs)
    check_float("inference_logprobs", inference_logprobs)
    check_same_shape("logprobs", logprobs, "inference_logprobs", inference_logprobs)
    check_probability("mask_low", mask_low)
    check_probability("mask_high", mask_high)
    return _broadcast_advantages(advantages, logprobs)


def _dppo_mask(
    logprobs: Tensor, inference_logprobs: Tensor, adv: Tensor, mask_low: float, mask_high: float
) -> Tensor:
    """:func:`dppo_mask` on validated inputs (``adv`` broadcastable to [B, T])."""
    with torch.no_grad():
        dp = torch.exp(logprobs.detach()) - torch.exp(inference_logprobs.detach())
        masked = ((adv > 0) & (dp > mask_high)) | ((adv <= 0) & (dp < -mask_low))
    return masked.expand_as(logprobs)


def dppo_loss(
    logprobs: Tensor,
    inference_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    mask_low: float = PolicyOptions.dppo_mask_low,
    mask_high: float = PolicyOptions.dppo_mask_high,
    adv_tau: float = 1.0,
    kl_tau: float = 1e-3,
) -> tuple[Tensor, dict[str, Tensor]]:
    """PRIME-RL default loss per token (DPPO-Binary-TV + Kimi K2.5 KL; arXiv 2602.04879, 2602.02276).

    ``δ = ℓtrain − ℓinf``, ``ρ = e^δ``, ``L_t = −1[¬masked]·adv_tau·A·ρ + kl_tau·m·δ²`` with the mask of
    :func:`dppo_mask`. Returned per token and NOT reduced (PRIME-RL divides by the global loss-token count;
    use :func:`aggregate_loss` with ``loss_type="dapo"``). Metrics (detached tensors): ``masked_fraction``,
    ``mismatch_kl`` (mean ``δ²/2`` over ``mask``).
    """
    adv = _check_dppo(logprobs, inference_logprobs, advantages, mask_low, mask_high)
    m_bool = as_mask("mask", mask, logprobs.shape, device=logprobs.device)
    masked = _dppo_mask(logprobs, inference_logprobs, adv, mask_low, mask_high)
    m = m_bool.to(logprobs.dtype)
    keep = (~masked).to(logprobs.dtype) * m
    log_ratio = logprobs - inference_logprobs.detach()
    ratio = torch.exp(log_ratio)
    per_token = -keep * adv_tau * adv * ratio + kl_tau * m * log_ratio * log_ratio
    with torch.no_grad():
        n = m.sum().clamp(min=1.0)
        metrics = {
            "masked_fraction": (masked.to(logprobs.dtype) * m).sum() / n,
            "mismatch_kl": (0.5 * log_ratio.detach() ** 2 * m).sum() / n,
        }
    return per_token, metrics


@dataclass
class PolicyLossOutput:
    """Result of :func:`policy_loss`: the scalar ``loss`` (with grad) and ``metrics``
    (:class:`~composer_core.loss.metrics.Metrics`: floats on read, detached tensors via ``.tensors()``)."""

    loss: Tensor
    metrics: Metrics = field(default_factory=Metrics)


def policy_loss(
    logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    options: PolicyOptions = _DEFAULT_OPTIONS,
    old_logprobs: Tensor | None = None,
    ref_logprobs: Tensor | None = None,
    rollout_is_weights: Tensor | None = None,
    inference_logprobs: Tensor | None = None,
    surrogate_mask: Tensor | None = None,
    normalizer: float | Tensor | None = None,
) -> PolicyLossOutput:
    """GRPO-family policy loss, op order of TRL 1.16 ``GRPOTrainer._compute_loss``.

    ``L_t = S_t(ρ, A) · k_t · w_t + kl_beta·KL_t``, aggregated by ``loss_type`` (see :func:`aggregate_loss`);
    ``ρ = exp(ℓθ − ℓold)`` per token, or GSPO's length-normalised sequence ratio [B, 1]
    (``importance_sampling_level='sequence'``); ``k_t`` the ``surrogate_mask``; ``w_t`` the rollout-correction
    weight. The surrogate ``S_t`` by ``loss_type``: ``grpo``/``bnpo``/``dr_grpo``/``dapo``/``luspo``
    ``−min(ρA, clip(ρ, 1−ε_lo, 1+ε_hi)A)``; ``cispo``/``sapo``/``vespo`` see :mod:`composer_core.loss.surrogates`
    (for ``vespo`` the rollout weight enters the gamma weight instead of multiplying ``S_t``).

    Args:
        logprobs: [B, T] log-prob of each sampled token under the current policy (with grad).
        advantages: [B] or [B, T].
        mask: [B, T] completion mask (bool or 0/1); must select at least one token.
        options: :class:`~composer_core.loss.config.PolicyOptions` (``loss_type``, clip range, KL, rollout
            correction, ...), checked when it was built; the default is ``PolicyOptions()`` (``dapo``).
        old_logprobs: [B, T] sampling-time policy log-probs; ``None`` → ``logprobs.detach()`` (ratio 1,
            TRL ``num_iterations=1``).
        ref_logprobs: [B, T] reference-model log-probs; required iff ``kl_beta != 0``.
        rollout_is_weights: [B, T] precomputed detached IS weights (TRL ``importance_sampling_ratio``,
            verl ``rollout_is_weights``); multiplies the surrogate. Exclusive with ``rollout_correction``.
        inference_logprobs: [B, T] inference-engine log-probs; required iff ``rollout_correction`` is set (a
            weight mode compares them with ``old_logprobs``, ``"dppo_mask"`` with ``logprobs``).
        surrogate_mask: [B, T] or [B, 1] bool/0-1 tokens whose surrogate counts (TRL's high-entropy mask and
            off-policy sequence mask); the KL term and the aggregation's denominators ignore it.
        normalizer: see :func:`aggregate_loss`.

    Metrics: ``policy/clip_ratio`` (masked mean of clipped tokens), ``policy/kl`` (if ``kl_beta``),
    ``policy/rollout_is_weight`` (masked mean weight) or ``policy/dppo_masked`` (masked fraction).
    """
    check_float("logprobs", logprobs, ndim=2)
    # an all-masked micro-batch (every completion truncated under mask_truncated_completions, ...) is a loss of
    # 0 with zero gradients, as in TRL: the normalisers are clamped to >= 1
    m_bool = as_mask("mask", mask, logprobs.shape, device=logprobs.device, require_nonempty=False)
    _check_policy_tensors(
        logprobs, old_logprobs, ref_logprobs, rollout_is_weights, inference_logprobs, surrogate_mask
    )
    o = options
    _check_rollout_inputs(o.rollout_correction, rollout_is_weights, inference_logprobs)
    _check_kl_inputs(o.kl_beta, ref_logprobs)
    check_normalizer("normalizer", normalizer)
    adv = _broadcast_advantages(advantages, logprobs)
    old = logprobs.detach() if old_logprobs is None else old_logprobs

    # Same op sequence as TRL 1.16 GRPOTrainer._compute_loss (graph-creation order fixes the order in which
    # autograd accumulates gradients, so even the gradients are bit-identical).
    m_f = m_bool.to(logprobs.dtype)
    log_ratio = logprobs - old.detach()
    coef_1 = torch.exp(log_importance_weights(log_ratio, m_f, o.importance_sampling_level))
    per_token_kl: Tensor | None = None
    if o.kl_beta != 0.0:
        assert ref_logprobs is not None
        per_token_kl = _kl_unchecked(logprobs, ref_logprobs.detach(), o.kl_estimator)
        if o.kl_bias_correction:
            per_token_kl = per_token_kl * coef_1  # TRL 1.16: after the KL, before the δ clamp of the ratio
    metrics: dict[str, Tensor | float] = {}
    n_tok = m_f.sum().clamp(min=1.0)

    def masked_mean(x: Tensor) -> Tensor:
        return ((x.detach().to(m_f.dtype) * m_f).sum() / n_tok).detach()

    shape = {
        "sapo": (o.sapo_temperature_pos, o.sapo_temperature_neg),
        "vespo": (o.vespo_k_pos, o.vespo_lambda_pos, o.vespo_k_neg, o.vespo_lambda_neg),
    }.get(o.loss_type, ())
    per_token_loss, is_clipped, phi = _surrogate(
        o.loss_type, coef_1, log_ratio, logprobs, adv, m_f, rollout_is_weights, (*o.epsilons, o.delta), shape
    )
    if phi is not None:  # vespo: the rollout IS weight is folded into the gamma weight
        metrics["policy/vespo_phi"] = masked_mean(phi.expand_as(m_f))
        rollout_is_weights = None
    if surrogate_mask is not None:
        per_token_loss = per_token_loss * surrogate_mask
    if o.rollout_correction == "dppo_mask":
        assert inference_logprobs is not None
        masked = _dppo_mask(logprobs, inference_logprobs, adv, o.dppo_mask_low, o.dppo_mask_high)
        per_token_loss = per_token_loss * (~masked)
        metrics["policy/dppo_masked"] = masked_mean(masked)
    else:
        if o.rollout_correction is not None:
            assert inference_logprobs is not None
            rollout_is_weights = _rollout_weights(
                old, inference_logprobs, m_bool, o.rollout_correction, o.rollout_clip_max, o.rollout_clip_min
            )
        if rollout_is_weights is not None:
            per_token_loss = per_token_loss * rollout_is_weights.detach()
            metrics["policy/rollout_is_weight"] = masked_mean(rollout_is_weights)
    if per_token_kl is not None:
        per_token_loss = per_token_loss + o.kl_beta * per_token_kl
        metrics["policy/kl"] = masked_mean(per_token_kl)

    m_agg = mask if (mask.dtype != torch.bool and mask.is_floating_point()) else m_f
    loss = _aggregate(per_token_loss, m_agg, o.loss_type, normalizer, o.max_completion_length)
    metrics["policy/clip_ratio"] = masked_mean(is_clipped)
    return PolicyLossOutput(loss=loss, metrics=Metrics(metrics))


def _surrogate(
    loss_type: str,
    coef_1: Tensor,
    log_ratio: Tensor,
    logprobs: Tensor,
    adv: Tensor,
    m_f: Tensor,
    is_weights: Tensor | None,
    clip: tuple[float, float, float | None],
    shape: tuple[float, ...],
) -> tuple[Tensor, Tensor, Tensor | None]:
    """The per-token surrogate of ``loss_type`` given ρ (``coef_1``): (loss [B, T], is_clipped, VESPO's φ or None)."""
    eps_lo, eps_hi, delta = clip
    if loss_type in CLIP_LOSS_TYPES:
        per_token_loss, is_clipped = clipped_surrogate_from_ratio(coef_1, adv, eps_lo, eps_hi, delta)
        return per_token_loss, is_clipped, None
    if loss_type == "cispo":
        per_token_loss = cispo_surrogate(coef_1, adv, logprobs, eps_hi)
        return per_token_loss, ((coef_1 > eps_hi) & (adv > 0)).detach().expand_as(per_token_loss), None
    if loss_type == "sapo":
        per_token_loss = sapo_surrogate(coef_1, adv, *shape)
        return per_token_loss, torch.zeros_like(per_token_loss, dtype=torch.bool), None
    phi = vespo_weights(adv, log_ratio, m_f, is_weights, *shape)
    per_token_loss = -phi * adv * logprobs
    return per_token_loss, torch.zeros_like(per_token_loss, dtype=torch.bool), phi


def _check_policy_tensors(
    logprobs: Tensor,
    old_logprobs: Tensor | None,
    ref_logprobs: Tensor | None,
    rollout_is_weights: Tensor | None,
    inference_logprobs: Tensor | None,
    surrogate_mask: Tensor | None,
) -> None:
    """Dtype and shape of :func:`policy_loss`'s optional tensors (each [B, T]; the IS weights and the surrogate mask
    may be [B, 1])."""
    for name, t in (("old_logprobs", old_logprobs), ("ref_logprobs", ref_logprobs),
                    ("inference_logprobs", inference_logprobs)):  # fmt: skip
        if t is not None:
            check_float(name, t)
            check_same_shape("logprobs", logprobs, name, t)
    per_sequence = (logprobs.shape[0], 1)
    if rollout_is_weights is not None:
        check_float("rollout_is_weights", rollout_is_weights)
        if rollout_is_weights.shape != per_sequence:  # TRL's sequence-level modes give [B, 1]
            check_same_shape("logprobs", logprobs, "rollout_is_weights", rollout_is_weights)
    if surrogate_mask is not None and surrogate_mask.shape not in (logprobs.shape, per_sequence):
        raise ValueError(
            f"`surrogate_mask` must be [B, T] = {tuple(logprobs.shape)} or [B, 1], got {tuple(surrogate_mask.shape)}."
        )


def _check_rollout_inputs(
    mode: str | None, rollout_is_weights: Tensor | None, inference_logprobs: Tensor | None
) -> None:
    """The rollout-correction inputs of :func:`policy_loss`: one source of weights, and its inputs."""
    if rollout_is_weights is not None and mode is not None:
        raise ValueError(
            "pass either precomputed `rollout_is_weights` or `rollout_correction` (computed here), not both."
        )
    if mode is not None and inference_logprobs is None:
        raise ValueError(
            f"rollout_correction={mode!r} needs `inference_logprobs` (the inference engine's "
            "log-probs of the sampled tokens); pass them or set rollout_correction=None."
        )
    if inference_logprobs is not None and mode is None:
        raise ValueError(
            "`inference_logprobs` is only used by `rollout_correction`; set rollout_correction (e.g. "
            "'token_truncate', 'sequence_mask', 'dppo_mask') or drop inference_logprobs."
        )


def _check_kl_inputs(kl_beta: float, ref_logprobs: Tensor | None) -> None:
    """The KL-penalty input of :func:`policy_loss`: a reference exactly when ``kl_beta != 0``."""
    if kl_beta != 0.0 and ref_logprobs is None:
        raise ValueError(
            f"kl_beta={kl_beta} needs `ref_logprobs`; pass the reference model's log-probs or kl_beta=0."
        )
    if kl_beta == 0.0 and ref_logprobs is not None:
        raise ValueError("`ref_logprobs` is only used when kl_beta != 0; set kl_beta or drop ref_logprobs.")
