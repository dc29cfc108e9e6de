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
``composer_core.loss.distill.sampled_token_distill``.

Channel 3 (preference replay) has no per-sample form; :mod:`composer_prime_rl.options`
raises if it is requested.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
from composer_core.loss.distill import sampled_token_distill
from composer_core.loss.policy import clipped_surrogate, dppo_loss
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
    zero_filled: bool


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
    ref = None if ref is None or opts.alpha_sdpo == 0 else _float("ref_logprobs", ref, n)
    weights = read_loss_weights(inputs)
    weights = None if weights is None else _float("loss_weights", weights, n)

    # Every data-dependent check in ONE device sync (the loss runs once per sample).
    checked = {"trainer_logprobs": logprobs, "inference_logprobs": inference, "advantages": advantages}
    if weights is not None:
        checked["loss_weights"] = weights
    if ref is not None:
        checked["ref_logprobs"] = ref
    outside = ~mask  # no boolean indexing: it would sync the device once per field
    stats = [(torch.isfinite(t.detach()) | outside).all() for t in checked.values()]
    stats.append(mask.sum())
    if ref is not None:
        stats.append((ref.detach() == 0).all())  # over the whole sample, prompt tokens included
    values = torch.stack([v.to(device=logprobs.device, dtype=torch.int64) for v in stats]).tolist()
    for name, finite in zip(checked, values, strict=False):
        if not finite:
            raise ValueError(
                f"LossInputs.{name} has NaN or inf on tokens selected by loss_mask; fix the producer "
                "of this field (values outside loss_mask are ignored)."
            )
    n_tokens = values[len(checked)]
    zero_filled = ref is not None and bool(values[-1])
    if zero_filled:
        # PRIME-RL's packer fills ref_logprobs with 0.0 over the whole sample when the sample
        # has none but a neighbour in its micro-batch has some (trainer/batch.py): that is no
        # teacher (it would pull every token towards p = 1). Such a sample comes from a source
        # without hints while the run does ship them, so it is skipped, never an error.
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
        n_tokens=n_tokens,
        zero_filled=zero_filled,
    )


# A metric is the mean of ``values`` over the bool ``where`` (0 when empty); all of a sample's
# metrics are reduced together in one batched op (see _reduce_metrics).
MetricSpec = tuple[Tensor, Tensor]


def _policy_terms(s: _Sample, opts: PrimeRLLossOptions) -> tuple[Tensor, dict[str, MetricSpec]]:
    """Per-token channel-1 loss [seq] (zero outside the mask) and its diagnostics."""
    lp, inf, adv, m = s.logprobs[None], s.inference_logprobs[None], s.advantages[None], s.mask[None]
    log_ratio = (s.logprobs - s.inference_logprobs).detach()
    mismatch_kl = torch.exp(log_ratio) - log_ratio - 1.0  # k3 estimate of KL(π_inf‖π_train)
    if opts.policy_loss == "clipped_surrogate":
        per_token, is_clipped = clipped_surrogate(
            lp, inf, adv, epsilon_low=opts.epsilon_low, epsilon_high=opts.epsilon_high, delta=opts.delta
        )
        return per_token[0], {
            "composer/policy/clip_ratio": (is_clipped[0], s.mask),
            "mismatch_kl": (mismatch_kl, s.mask),
        }

    # |Δp| < 1 always, so a bound above 1 (PRIME-RL allows any value >= 0, e.g. 10 to turn
    # masking off) masks exactly what a bound of 1 masks: nothing.
    low, high = min(opts.dppo_mask_low, 1.0), min(opts.dppo_mask_high, 1.0)
    per_token, _ = dppo_loss(
        lp, inf, adv, m, mask_low=low, mask_high=high, adv_tau=opts.adv_tau, kl_tau=opts.kl_tau
    )
    # The diagnostics re-derive dppo_mask's rule from Δp (one exp each instead of a second
    # validated core call); test_upstream.py checks them against PRIME-RL's own metrics.
    prob_diff = (torch.exp(s.logprobs) - torch.exp(s.inference_logprobs)).detach()
    positive, negative = s.advantages > 0, s.advantages < 0
    too_high, too_low = prob_diff > high, prob_diff < -low
    masked = torch.where(positive, too_high, too_low)
    dropped = masked & s.mask
    return per_token[0], {
        # PRIME-RL's default_loss_fn metric names and definitions (dashboards carry over).
        "masked_mismatch_kl": (mismatch_kl, dropped),
        "unmasked_mismatch_kl": (mismatch_kl, s.mask & ~masked),
        "is_masked": (masked, s.mask),
        "is_masked_low": (negative & too_low, s.mask),
        "is_masked_high": (positive & too_high, s.mask),
        "masked_advantage_positive": (positive, dropped),
        "masked_advantage_negative": (negative, dropped),
    }


def _sdpo_terms(s: _Sample, opts: PrimeRLLossOptions) -> tuple[Tensor, dict[str, MetricSpec]]:
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
    return per_token, {"composer/sdpo/reverse_kl_k1": (s.logprobs - s.ref_logprobs, s.mask)}


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
        count) and 0-dim detached ``metrics``: ``composer/loss/policy``, ``composer/loss/sdpo`` and
        ``composer/loss/total`` (per-token means of this sample), the policy diagnostics (PRIME-RL's
        DPPO names, or ``composer/policy/clip_ratio`` + ``mismatch_kl``), and with channel 2 on
        ``composer/sdpo/reverse_kl_k1`` and ``composer/sdpo/skipped``. Every call of a run emits the same keys.

        A sample whose ``loss_mask`` selects no token (PRIME-RL calls the loss for it when
        no rl weight stream exists) returns an exact 0 that is still attached to the graph
        (zero gradient, no NaN) and zero metrics: emptiness is judged per batch by PRIME-RL
        (its global count), not per sample.

    Raises:
        ValueError: bad kwargs (see :func:`composer_prime_rl.options.parse_options`), a
            field that is not a 1-D tensor of the sample's length, a non-boolean mask,
            NaN/inf on masked tokens, or channel 2 on without ``ref_logprobs`` (None) while
            ``sdpo_missing = "error"``. A sample whose ``ref_logprobs`` are 0.0 everywhere
            (PRIME-RL's packer fill for a sample without them) is skipped on channel 2.
    """
    opts = parse_options(kwargs)
    s = _read_sample(inputs, opts)
    zeros = torch.zeros_like(s.logprobs)

    specs: dict[str, MetricSpec] = {}
    if s.n_tokens > 0:
        policy, specs = _policy_terms(s, opts)
    else:
        policy = zeros * s.logprobs  # keep the graph; the metrics are all 0 below

    distill: Tensor | None = None
    skipped = False
    if opts.alpha_sdpo > 0:
        skipped = s.ref_logprobs is None and s.n_tokens > 0
        if skipped and not s.zero_filled and opts.sdpo_missing == "error":
            raise ValueError(
                "alpha_sdpo > 0 but this sample has no ref_logprobs (LossInputs.ref_logprobs is None): "
                "PRIME-RL fills them only when the orchestrator's algorithm scores samples under a "
                "reference (the hinted context of composer's self-teacher). Ship hinted-context "
                'log-probs as ref_logprobs, set sdpo_missing = "skip" to train such samples on the '
                "policy loss only, or set alpha_sdpo = 0."
            )
        if s.n_tokens > 0 and not skipped:
            distill, sdpo_specs = _sdpo_terms(s, opts)
            specs.update(sdpo_specs)

    per_token = policy if distill is None else policy + opts.alpha_sdpo * distill
    if s.weights is not None:
        per_token = per_token * s.weights
    loss = torch.where(s.mask, per_token, zeros).sum()

    if s.n_tokens > 0:
        weighted_policy = policy if s.weights is None else policy * s.weights
        specs["composer/loss/policy"] = (weighted_policy, s.mask)
        if distill is not None:
            specs["composer/loss/sdpo"] = (distill if s.weights is None else distill * s.weights, s.mask)
        specs["composer/loss/total"] = (per_token, s.mask)
    metrics = _reduce_metrics(specs, _metric_keys(opts), s.logprobs.device)
    if opts.alpha_sdpo > 0:
        metrics["composer/sdpo/skipped"] = torch.tensor(float(skipped), device=s.logprobs.device)
    return LossOutputs(loss=loss, metrics=metrics)


def _metric_keys(opts: PrimeRLLossOptions) -> tuple[str, ...]:
    """The metric keys of a run (every call emits the same ones, so PRIME-RL can stack them)."""
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
        keys = ("composer/policy/clip_ratio", "mismatch_kl")
    keys += ("composer/loss/policy", "composer/loss/total")
    if opts.alpha_sdpo > 0:
        keys += ("composer/loss/sdpo", "composer/sdpo/reverse_kl_k1")
    return keys


def _reduce_metrics(
    specs: dict[str, MetricSpec], keys: tuple[str, ...], device: torch.device
) -> dict[str, Tensor]:
    """Detached float32 0-dim means ``Σ v·1[where] / max(Σ 1[where], 1)`` for ``keys`` in one
    batched reduction; a key without a spec (empty mask, skipped channel) is 0."""
    present = [k for k in keys if k in specs]
    out = dict.fromkeys(keys, torch.zeros((), dtype=torch.float32, device=device))
    if present:
        values = torch.stack([specs[k][0].detach().to(torch.float32) for k in present])
        where = torch.stack([specs[k][1] for k in present]).to(torch.float32)
        means = (values * where).sum(dim=1) / where.sum(dim=1).clamp(min=1)
        out.update(zip(present, means.unbind(), strict=True))
    return out
