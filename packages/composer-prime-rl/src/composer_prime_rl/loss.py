"""``composer_loss``: composer's objective as a PRIME-RL custom rl loss, one sample per call.

PRIME-RL contract (``prime_rl.trainer.rl.loss``): the trainer calls ``fn(inputs, **kwargs)``
once per packed sample with 1-D per-token tensors and divides the sum of the returned
losses by the global rl-token count N (all-reduced over micro-batches and ranks). So the
function returns the **sum** over the sample's masked tokens, never a mean:

    loss_i = Σ_t m_t · w_t · ( L^policy_t + α · L^sdpo_t )

with m = ``loss_mask``, w = ``loss_weights`` (1 when None). Summed over samples and divided
by N this is exactly composer_core's token-level (``loss_type = "dapo"``) policy loss plus
α × the sampled-token distillation loss, both normalised by the same global count.

Channel 1, ``policy_loss = "dppo"`` (PRIME-RL's default, DPPO arXiv 2602.04879 with the
Kimi-K2.5 KL of arXiv 2602.02276), with δ = ℓ_train − ℓ_inf, ρ = e^δ,
Δp = e^{ℓ_train} − e^{ℓ_inf}:

    masked_t = (A_t > 0 ∧ Δp_t > dppo_mask_high) ∨ (A_t ≤ 0 ∧ Δp_t < −dppo_mask_low)
    L^policy_t = −1[¬masked_t] · adv_tau · A_t · ρ_t + kl_tau · δ_t²

``policy_loss = "clipped_surrogate"`` (PPO, Schulman et al. 2017; GRPO, Shao et al. 2024)
with the importance ratio against the inference engine:

    L^policy_t = −min(ρ_t A_t, clip(ρ_t, 1 − ε_low, 1 + ε_high) A_t)

Channel 2 (``alpha_sdpo > 0``), sampled-token self-distillation (SDPO, arXiv 2601.20802;
on-policy distillation estimator): ``ref_logprobs`` are the log-probs of the sampled tokens
under the same policy given a hint (the self-teacher). Per token the gradient is
``sg(ℓ_train − ℓ_ref) · min(e^{ℓ_train − ℓ_inf}, sdpo_token_clip) · ∇ℓ_train`` (an unbiased
reverse-KL(π‖π_hint) gradient on the sampled tokens); see
``composer_core.distill.sampled_token_distill``.

Channel 3 (preference replay) has no per-sample form; :mod:`composer_prime_rl.options`
raises if it is requested.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
from composer_core.distill import sampled_token_distill
from composer_core.policy import clipped_surrogate, dppo_loss, dppo_mask
from torch import Tensor

from composer_prime_rl.contract import LossInputs, LossOutputs, read_loss_weights, read_ref_logprobs
from composer_prime_rl.options import PrimeRLLossOptions, parse_options

__all__ = ["composer_loss"]


class _Sample(NamedTuple):
    """One sample's validated tensors; positions outside ``mask`` are zeroed."""

    logprobs: Tensor
    inference_logprobs: Tensor
    ref_logprobs: Tensor | None
    advantages: Tensor
    mask: Tensor
    weights: Tensor | None
    n_tokens: int


def _tensor(name: str, value: Any, length: int | None) -> Tensor:
    if not isinstance(value, Tensor):
        raise ValueError(f"LossInputs.{name} must be a torch.Tensor, got {type(value).__name__}.")
    if value.dim() != 1:
        raise ValueError(
            f"LossInputs.{name} must be 1-D (one sample's tokens; PRIME-RL calls the loss once per "
            f"sample), got shape {tuple(value.shape)}."
        )
    if length is not None and value.shape[0] != length:
        raise ValueError(
            f"LossInputs.{name} has {value.shape[0]} tokens but trainer_logprobs has {length}; "
            "every per-token field must have the same length."
        )
    return value


def _float(name: str, value: Any, length: int | None) -> Tensor:
    t = _tensor(name, value, length)
    if not t.is_floating_point():
        raise ValueError(f"LossInputs.{name} must be a floating-point tensor, got {t.dtype}.")
    return t


def _check_finite(name: str, value: Tensor, mask: Tensor) -> None:
    if not bool(torch.isfinite(value[mask]).all()):
        raise ValueError(
            f"LossInputs.{name} has NaN or inf on tokens selected by loss_mask; fix the producer "
            "of this field (values outside loss_mask are ignored)."
        )


def _read_sample(inputs: Any, opts: PrimeRLLossOptions) -> _Sample:
    logprobs = _float("trainer_logprobs", getattr(inputs, "trainer_logprobs", None), None)
    n = logprobs.shape[0]
    inference = _float("inference_logprobs", getattr(inputs, "inference_logprobs", None), n)
    advantages = _float("advantages", getattr(inputs, "advantages", None), n)
    raw_mask = _tensor("loss_mask", getattr(inputs, "loss_mask", None), n)
    if raw_mask.dtype != torch.bool:
        if not bool(((raw_mask == 0) | (raw_mask == 1)).all()):
            raise ValueError("LossInputs.loss_mask must be boolean (or 0/1); it has other values.")
        raw_mask = raw_mask != 0
    mask = raw_mask.to(logprobs.device)
    ref = read_ref_logprobs(inputs)
    ref = None if ref is None else _float("ref_logprobs", ref, n)
    weights = read_loss_weights(inputs)
    weights = None if weights is None else _float("loss_weights", weights, n)

    _check_finite("trainer_logprobs", logprobs, mask)
    _check_finite("inference_logprobs", inference, mask)
    _check_finite("advantages", advantages, mask)
    if weights is not None:
        _check_finite("loss_weights", weights, mask)
    if ref is not None and opts.alpha_sdpo > 0:
        _check_finite("ref_logprobs", ref, mask)
        if bool(mask.any()) and bool((ref[mask] == 0).all()):
            # PRIME-RL's packer zero-fills ref_logprobs of a sample that has none when a
            # neighbour in the micro-batch has some (trainer/batch.py): log-prob 0 on every
            # token is that fill, not a teacher, and would pull every token towards p = 1.
            ref = None

    def keep(t: Tensor) -> Tensor:  # zero the tokens outside the mask (no NaN can leak)
        return torch.where(mask, t, torch.zeros((), dtype=t.dtype, device=t.device))

    return _Sample(
        logprobs=keep(logprobs),
        inference_logprobs=keep(inference.detach()),
        ref_logprobs=None if ref is None else keep(ref.detach()),
        advantages=keep(advantages.detach()),
        mask=mask,
        weights=None if weights is None else keep(weights.detach()),
        n_tokens=int(mask.sum()),
    )


def _mean(values: Tensor, where: Tensor) -> Tensor:
    """Mean of ``values`` over the bool ``where`` (0 when empty), detached."""
    v = values.detach().to(torch.float32)
    return (v * where).sum() / where.sum().clamp(min=1)


def _policy_terms(s: _Sample, opts: PrimeRLLossOptions) -> tuple[Tensor, dict[str, Tensor]]:
    """Per-token channel-1 loss [seq] (zero outside the mask) and its diagnostics."""
    lp, inf, adv, m = s.logprobs[None], s.inference_logprobs[None], s.advantages[None], s.mask[None]
    log_ratio = (s.logprobs - s.inference_logprobs).detach()
    mismatch_kl = torch.exp(log_ratio) - log_ratio - 1.0  # k3 estimate of KL(π_inf‖π_train)
    if opts.policy_loss == "dppo":
        # |Δp| < 1 always, so a bound above 1 (PRIME-RL allows any value >= 0, e.g. 10 to turn
        # masking off) masks exactly what a bound of 1 masks: nothing.
        low, high = min(opts.dppo_mask_low, 1.0), min(opts.dppo_mask_high, 1.0)
        per_token, _ = dppo_loss(
            lp, inf, adv, m, mask_low=low, mask_high=high, adv_tau=opts.adv_tau, kl_tau=opts.kl_tau
        )
        masked = dppo_mask(lp, inf, adv, mask_low=low, mask_high=high)[0]
        dropped = masked & s.mask
        prob_diff = (torch.exp(s.logprobs) - torch.exp(s.inference_logprobs)).detach()
        positive, negative = s.advantages > 0, s.advantages < 0
        metrics = {
            # PRIME-RL's default_loss_fn metric names and definitions (dashboards carry over).
            "masked_mismatch_kl": _mean(mismatch_kl, dropped),
            "unmasked_mismatch_kl": _mean(mismatch_kl, s.mask & ~masked),
            "is_masked": _mean(masked, s.mask),
            "is_masked_low": _mean(negative & (prob_diff < -opts.dppo_mask_low), s.mask),
            "is_masked_high": _mean(positive & (prob_diff > opts.dppo_mask_high), s.mask),
            "masked_advantage_positive": _mean(positive, dropped),
            "masked_advantage_negative": _mean(negative, dropped),
        }
    else:
        per_token, is_clipped = clipped_surrogate(
            lp, inf, adv, epsilon_low=opts.epsilon_low, epsilon_high=opts.epsilon_high, delta=opts.delta
        )
        metrics = {
            "policy/clip_ratio": _mean(is_clipped[0], s.mask),
            "mismatch_kl": _mean(mismatch_kl, s.mask),
        }
    return per_token[0], metrics


def _sdpo_terms(s: _Sample, opts: PrimeRLLossOptions) -> tuple[Tensor, dict[str, Tensor]]:
    """Per-token channel-2 loss [seq] (zero outside the mask) and its diagnostics."""
    assert s.ref_logprobs is not None
    per_token = sampled_token_distill(
        s.logprobs[None],
        s.ref_logprobs[None],
        s.mask[None],
        old_logprobs=s.inference_logprobs[None],
        is_clip=opts.sdpo_token_clip,
        reduction="none",
    )[0]
    return per_token, {"sdpo/reverse_kl_k1": _mean(s.logprobs - s.ref_logprobs, s.mask)}


def composer_loss(inputs: LossInputs, **kwargs: Any) -> LossOutputs:
    """composer's loss for one PRIME-RL sample: ``[trainer.loss] import_path = "composer_prime_rl.composer_loss"``.

    Args:
        inputs: PRIME-RL's ``LossInputs`` for one sample (1-D tensors of equal length):
            ``trainer_logprobs`` (grad), ``inference_logprobs``, ``ref_logprobs`` (or its
            pre-0be5ac45 name ``teacher_logprobs``), ``advantages``, ``loss_mask``,
            ``loss_weights`` (optional).
        **kwargs: ``[trainer.loss.kwargs]``; see :class:`composer_prime_rl.options.PrimeRLLossOptions`.

    Returns:
        ``LossOutputs`` with ``loss`` = the SUM over masked tokens of
        ``w_t (L^policy_t + alpha_sdpo L^sdpo_t)`` (PRIME-RL divides by the global token
        count) and 0-dim detached ``metrics``: ``loss/policy``, ``loss/sdpo`` and
        ``loss/total`` (per-token means of this sample), the policy diagnostics (PRIME-RL's
        DPPO names, or ``policy/clip_ratio`` + ``mismatch_kl``), and with channel 2 on
        ``sdpo/reverse_kl_k1`` and ``skipped/sdpo``. Every call of a run emits the same keys.

        A sample whose ``loss_mask`` selects no token (PRIME-RL calls the loss for it when
        no rl weight stream exists) returns an exact 0 that is still attached to the graph
        (zero gradient, no NaN) and zero metrics: emptiness is judged per batch by PRIME-RL
        (its global count), not per sample.

    Raises:
        ValueError: bad kwargs (see :func:`composer_prime_rl.options.parse_options`), a
            field that is not a 1-D tensor of the sample's length, a non-boolean mask,
            NaN/inf on masked tokens, or channel 2 on without ``ref_logprobs`` while
            ``sdpo_missing = "error"``.
    """
    opts = parse_options(kwargs)
    s = _read_sample(inputs, opts)
    zeros = torch.zeros_like(s.logprobs)

    if s.n_tokens > 0:
        policy, metrics = _policy_terms(s, opts)
    else:
        policy, metrics = zeros * s.logprobs, {}  # keep the graph; metrics filled with 0 below

    distill: Tensor | None = None
    if opts.alpha_sdpo > 0:
        skipped = s.ref_logprobs is None and s.n_tokens > 0
        if skipped and opts.sdpo_missing == "error":
            raise ValueError(
                "alpha_sdpo > 0 but this sample has no ref_logprobs (None, or all zeros on its masked "
                "tokens, which is how PRIME-RL's packer fills a sample without them): PRIME-RL "
                "fills them only when the orchestrator's algorithm scores samples under a "
                "reference (the hinted context of composer's self-teacher). Ship hinted-context "
                'log-probs as ref_logprobs, set sdpo_missing = "skip" to train such samples on the '
                "policy loss only, or set alpha_sdpo = 0."
            )
        if s.n_tokens > 0 and not skipped:
            distill, sdpo_metrics = _sdpo_terms(s, opts)
            metrics.update(sdpo_metrics)
        metrics["skipped/sdpo"] = torch.tensor(float(skipped))

    per_token = policy if distill is None else policy + opts.alpha_sdpo * distill
    if s.weights is not None:
        per_token = per_token * s.weights
    loss = torch.where(s.mask, per_token, zeros).sum()

    w = s.weights if s.weights is not None else torch.ones_like(zeros)
    metrics["loss/policy"] = _mean(policy * w, s.mask)
    if opts.alpha_sdpo > 0:
        metrics["loss/sdpo"] = _mean((distill if distill is not None else zeros) * w, s.mask)
    metrics["loss/total"] = _mean(per_token, s.mask)
    return LossOutputs(loss=loss, metrics=_complete(metrics, opts, loss))


def _metric_keys(opts: PrimeRLLossOptions) -> tuple[str, ...]:
    keys: tuple[str, ...]
    if opts.policy_loss == "dppo":
        keys = (
            "masked_mismatch_kl",
            "unmasked_mismatch_kl",
            "is_masked",
            "is_masked_low",
            "is_masked_high",
            "masked_advantage_positive",
            "masked_advantage_negative",
        )
    else:
        keys = ("policy/clip_ratio", "mismatch_kl")
    keys += ("loss/policy", "loss/total")
    if opts.alpha_sdpo > 0:
        keys += ("loss/sdpo", "sdpo/reverse_kl_k1", "skipped/sdpo")
    return keys


def _complete(metrics: dict[str, Tensor], opts: PrimeRLLossOptions, like: Tensor) -> dict[str, Tensor]:
    """The run's fixed metric keys, 0 where this sample has none (empty mask, skipped SDPO)."""
    zero = torch.zeros((), dtype=torch.float32, device=like.device)
    return {k: metrics.get(k, zero).to(device=like.device) for k in _metric_keys(opts)}
