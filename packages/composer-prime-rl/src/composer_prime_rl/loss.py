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

import contextlib
import functools
import math
from collections.abc import Callable
from typing import Any, NamedTuple, NoReturn, cast

import torch
from composer_core.loss.distill import _sampled_token_distill, full_precision
from composer_core.loss.policy import _surrogate_from_ratio
from torch import Tensor

from composer_prime_rl.contract import LossInputs, LossOutputs, read_loss_weights, read_ref_logprobs
from composer_prime_rl.options import PrimeRLLossOptions, parse_options

__all__ = ["composer_loss"]


class _Sample(NamedTuple):
    """One sample's tensors, detached and zeroed outside ``mask`` (no NaN/inf can reach the loss or its
    gradient)."""

    logprobs: Tensor
    inference_logprobs: Tensor
    ref_logprobs: Tensor | None
    advantages: Tensor
    mask: Tensor
    weights: Tensor | None
    has_ref: Tensor | None  # 0-dim bool: the ref_logprobs are real (not PRIME-RL's zero fill); else None


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


def _fields(inputs: Any, opts: PrimeRLLossOptions) -> tuple[Tensor, Tensor, dict[str, Tensor]]:
    """Structural checks (no tensor values read): (trainer log-probs, raw mask, detached float fields)."""
    logprobs = _float("trainer_logprobs", getattr(inputs, "trainer_logprobs", None), None)
    n = logprobs.shape[0]
    fields = {
        "inference_logprobs": _float("inference_logprobs", getattr(inputs, "inference_logprobs", None), n),
        "advantages": _float("advantages", getattr(inputs, "advantages", None), n),
    }
    raw_mask = _tensor("loss_mask", getattr(inputs, "loss_mask", None), n)
    weights = read_loss_weights(inputs)
    if weights is not None:
        fields["loss_weights"] = _float("loss_weights", weights, n)
    ref = read_ref_logprobs(inputs)
    if ref is not None and opts.alpha_sdpo != 0:
        fields["ref_logprobs"] = _float("ref_logprobs", ref, n)
    return logprobs, raw_mask, fields


_NOT_BOOLEAN = "LossInputs.loss_mask must be boolean (or 0/1); it has other values."
_NON_FINITE = (
    "LossInputs.{name} has NaN or inf on tokens selected by loss_mask; fix the producer of this field "
    "(values outside loss_mask are ignored)."
)
_OVERFLOW = (
    "LossInputs fields are finite but so large that their sum over loss_mask overflows {dtype}; check the "
    "advantages' scale (values outside loss_mask are ignored)."
)


def _raise_bad_values(binary: Tensor | None, mask: Tensor, named: dict[str, Tensor]) -> NoReturn:
    """The fused check failed: name the first culprit (extra reads only on this error path). ``binary``: whether
    a non-bool mask holds only 0/1 (None for a bool mask)."""
    if binary is not None and not bool(binary):
        raise ValueError(_NOT_BOOLEAN)
    for name, t in named.items():
        if not bool((torch.isfinite(t) | ~mask).all()):
            raise ValueError(_NON_FINITE.format(name=name))
    raise ValueError(_OVERFLOW.format(dtype=named["trainer_logprobs"].dtype))


def _host_reads_are_free(device: torch.device) -> bool:
    """CPU tensors are already on the host: reading a flag costs no stall."""
    return device.type == "cpu"


def _check_values(
    total: Tensor, binary: Tensor | None, mask: Tensor, named: dict[str, Tensor], kept: Tensor
) -> None:
    """Raise if a value check fails: ``total`` (the sum of every kept value) is non-finite exactly when a
    selected token holds NaN/±inf (or the sum overflows); ``binary`` is whether a non-bool mask is 0/1. On CPU:
    one host read of ``total`` (``binary`` folded in), and the error names the culprit. On an
    accelerator: asynchronous device asserts (no host sync, so PRIME-RL's per-sample calls never stall the
    stream), one per field so the assert message names it; the failure surfaces at the next synchronisation
    as a device-side assert carrying that message."""
    if _host_reads_are_free(kept.device):
        if binary is not None:  # one read either way: a non-binary mask turns the total into NaN
            total = torch.where(binary, total, math.nan)
        if not math.isfinite(total.item()):
            _raise_bad_values(binary, mask, named)
        return
    with torch.no_grad():
        ok = total.isfinite()
        if binary is not None:
            ok &= binary
        finite = kept.isfinite().all(dim=1)  # per field, exact (kept is 0 outside the mask)
        for i, name in enumerate(named):
            torch._assert_async(finite[i], _NON_FINITE.format(name=name))
        if binary is not None:
            torch._assert_async(binary, _NOT_BOOLEAN)
        torch._assert_async(ok, _OVERFLOW.format(dtype=kept.dtype))


def _read_sample(inputs: Any, opts: PrimeRLLossOptions) -> _Sample:
    logprobs, raw_mask, fields = _fields(inputs, opts)
    device, dtype = logprobs.device, logprobs.dtype
    mask = (raw_mask if raw_mask.dtype == torch.bool else raw_mask != 0).to(device)
    named = {"trainer_logprobs": logprobs.detach(), **fields}
    with torch.no_grad():
        stacked = torch.stack([_as(t, device, dtype) for t in named.values()])
        kept = torch.where(mask, stacked, _zero(stacked))  # every field detached, zeroed outside the mask
        total = kept.sum()  # a NaN/±inf on a selected token makes the sum non-finite
        binary = (
            None if raw_mask.dtype == torch.bool else ((raw_mask == 0) | (raw_mask == 1)).all().to(device)
        )
        # PRIME-RL's packer fills ref_logprobs with 0.0 over the whole sample when the sample has none
        # but a neighbour in its micro-batch has some (trainer/batch.py): that is no teacher (it would pull
        # every token towards p = 1), so channel 2 is skipped for it, never an error (a 0-dim flag, no
        # branch on tensor values).
        has_ref = (stacked[-1] != 0).any() if "ref_logprobs" in fields else None
    _check_values(total, binary, mask, named, kept)
    by_name = dict(zip(named, kept.unbind(0), strict=True))
    return _Sample(
        logprobs=by_name["trainer_logprobs"],
        inference_logprobs=by_name["inference_logprobs"],
        ref_logprobs=by_name.get("ref_logprobs"),
        advantages=by_name["advantages"],
        mask=mask,
        weights=by_name.get("loss_weights"),
        has_ref=has_ref,
    )


def _as(t: Tensor, device: torch.device, dtype: torch.dtype) -> Tensor:
    """``t`` on ``device`` in ``dtype`` (itself when it already is: no dispatch)."""
    return t if t.dtype == dtype and t.device == device else t.to(device=device, dtype=dtype)


# A metric is Σ value·where / max(Σ where, 1) (0 when empty). All of a sample's metrics come from ONE matmul
# of the bool (where) columns with every per-token column (see _reduce_metrics): (value column, where column,
# denominator column) by name; where and denominator columns are bool.
MetricSpec = tuple[str, str, str]


def _policy_terms(
    s: _Sample, opts: PrimeRLLossOptions
) -> tuple[Tensor, Tensor, dict[str, Tensor], dict[str, MetricSpec]]:
    """Channel 1 per token [seq], detached and zero outside the mask: (loss, ∂loss/∂ℓ_train, metric columns,
    metric specs). The derivative is written out (see :func:`_clipped_grad`), so the call runs no autograd graph."""
    log_ratio = s.logprobs - s.inference_logprobs  # 0 outside the mask (both zeroed)
    ratio = torch.exp(log_ratio)
    mismatch_kl = ratio - log_ratio - 1.0  # k3 estimate of KL(π_inf‖π_train)
    if opts.policy_loss == "clipped_surrogate":
        eps_lo = float(opts.epsilon_low)
        eps_hi = eps_lo if opts.epsilon_high is None else float(opts.epsilon_high)
        per_token, is_clipped = _surrogate_from_ratio(ratio, s.advantages, eps_lo, eps_hi, opts.delta)
        grad = _clipped_grad(ratio, s.advantages, eps_lo, eps_hi, opts.delta)
        cols = {"clipped": is_clipped, "mismatch_kl": mismatch_kl}
        return (
            per_token,
            grad,
            cols,
            {
                "composer/policy/clip_ratio": ("clipped", "mask", "mask"),
                "mismatch_kl": ("mismatch_kl", "mask", "mask"),
            },
        )

    # DPPO (composer_core.loss.policy.dppo_loss, PRIME-RL's default_loss_fn), branch-free. |Δp| < 1 always, so
    # a bound above 1 (PRIME-RL allows any value >= 0, e.g. 10 to turn masking off) masks what 1 masks: nothing.
    # L = c·ρ + κ·δ² with c = −adv_tau·A on kept tokens (0 on dropped ones), so ∂L/∂ℓ = c·ρ + 2κ·δ.
    low, high = min(opts.dppo_mask_low, 1.0), min(opts.dppo_mask_high, 1.0)
    prob_diff = torch.exp(s.logprobs).sub_(torch.exp(s.inference_logprobs))  # Δp
    positive, negative = s.advantages > 0, s.advantages < 0
    masked = torch.where(positive, prob_diff > high, prob_diff < -low)
    dropped = masked & s.mask
    keep = s.mask ^ dropped
    coef_ratio = torch.where(keep, s.advantages, _zero(ratio)).mul_(-opts.adv_tau).mul_(ratio)  # c·ρ
    per_token = torch.addcmul(coef_ratio, log_ratio, log_ratio, value=opts.kl_tau)
    grad = torch.add(coef_ratio, log_ratio, alpha=2.0 * opts.kl_tau)
    cols = {
        "dropped": dropped,
        "keep": keep,
        "positive": positive,
        "negative": negative,
        "mismatch_kl": mismatch_kl,
    }
    # PRIME-RL's default_loss_fn metric names and definitions (dashboards carry over); for A < 0 "masked" is
    # "too low" and for A > 0 "too high", so the low/high splits are the sign columns over the dropped tokens.
    return (
        per_token,
        grad,
        cols,
        {
            "masked_mismatch_kl": ("mismatch_kl", "dropped", "dropped"),
            "unmasked_mismatch_kl": ("mismatch_kl", "keep", "keep"),
            "is_masked": ("dropped", "mask", "mask"),
            "is_masked_low": ("negative", "dropped", "mask"),
            "is_masked_high": ("positive", "dropped", "mask"),
            "masked_advantage_positive": ("positive", "dropped", "dropped"),
            "masked_advantage_negative": ("negative", "dropped", "dropped"),
        },
    )


def _clipped_grad(ratio: Tensor, adv: Tensor, eps_lo: float, eps_hi: float, delta: float | None) -> Tensor:
    """∂/∂ℓ of ``−min(ρ'·A, clip(ρ, 1 − ε_lo, 1 + ε_hi)·A)``, ρ' = min(ρ, δ), exactly as autograd
    differentiates it: clamp passes the gradient on its closed interval, ``min`` gives a tie half to
    each side, and ∂ρ/∂ℓ = ρ."""
    unclipped = adv if delta is None else torch.where(ratio <= delta, adv, _zero(adv))  # ∂(ρ'A)/∂ρ
    clipped = torch.where((ratio >= 1 - eps_lo) & (ratio <= 1 + eps_hi), adv, _zero(adv))  # ∂(clip(ρ)A)/∂ρ
    lhs = ratio if delta is None else ratio.clamp(max=delta)
    a, b = lhs * adv, torch.clamp(ratio, 1 - eps_lo, 1 + eps_hi) * adv
    picked = torch.where(a < b, unclipped, torch.where(a > b, clipped, (unclipped + clipped) * 0.5))
    return picked.mul_(ratio).neg_()


def _sdpo_terms(s: _Sample, opts: PrimeRLLossOptions) -> Tensor:
    """Channel 2 per token [seq], detached, zero outside the mask (``sampled_token_distill`` on checked
    inputs): the value w·(ℓ − ℓ_ref) is also its gradient coefficient by design (the k1 surrogate)."""
    assert s.ref_logprobs is not None
    return _sampled_token_distill(
        s.logprobs[None], s.ref_logprobs[None], s.mask[None], s.inference_logprobs[None], opts.sdpo_token_clip,
        "none", None,
    )[0]  # fmt: skip


class _WithGradient(torch.autograd.Function):
    """``Σ_t per_token`` as a function of ``trainer_logprobs`` whose gradient is the given per-token
    derivative: one multiply in backward instead of replaying the formula's autograd graph."""

    @staticmethod
    def forward(ctx: Any, logprobs: Tensor, per_token: Tensor, grad: Tensor) -> Tensor:
        ctx.save_for_backward(grad)
        return per_token.sum()

    @staticmethod
    def backward(ctx: Any, grad_output: Tensor) -> tuple[Tensor, None, None]:
        (grad,) = ctx.saved_tensors
        return grad * grad_output, None, None


_with_gradient = cast(Callable[..., Tensor], _WithGradient.apply)


def composer_loss(inputs: LossInputs, **kwargs: Any) -> LossOutputs:
    """composer's loss for one PRIME-RL sample: ``[trainer.loss] import_path = "composer_prime_rl.composer_loss"``.

    Args:
        inputs: PRIME-RL's ``LossInputs`` for one sample (1-D tensors of equal length):
            ``trainer_logprobs`` (grad), ``inference_logprobs``, ``ref_logprobs`` (or its
            pre-0be5ac45 name ``teacher_logprobs``), ``advantages``, ``loss_mask``,
            ``loss_weights`` (optional).
        **kwargs: ``[trainer.loss.kwargs]``; see :class:`composer_prime_rl.options.PrimeRLLossOptions`
            (validated once per distinct kwargs, then a cache lookup).

    Returns:
        ``LossOutputs`` with ``loss`` = the SUM over masked tokens of
        ``w_t (L^policy_t + alpha_sdpo L^sdpo_t)`` (PRIME-RL divides by the global token
        count) and 0-dim detached ``metrics``: ``composer/loss/policy``, ``composer/loss/sdpo`` and
        ``composer/loss/total`` (per-token means of this sample), the policy diagnostics (PRIME-RL's
        DPPO names, or ``composer/policy/clip_ratio`` + ``mismatch_kl``), and with channel 2 on
        ``composer/sdpo/reverse_kl_k1`` and ``composer/sdpo/skipped``. Every call of a run emits the same keys.
        Cost: structural checks in Python; every value check fused into one host read on CPU, and into
        asynchronous device asserts (no host sync) on an accelerator.

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
            On an accelerator the value checks (mask values, NaN/inf, overflow) are device asserts with
            the same messages instead: the error surfaces at the next synchronisation.
    """
    opts = parse_options(kwargs)
    s = _read_sample(inputs, opts)
    if (
        opts.alpha_sdpo > 0
        and s.ref_logprobs is None
        and opts.sdpo_missing == "error"
        and inputs_has_tokens(s)
    ):
        raise ValueError(
            "alpha_sdpo > 0 but this sample has no ref_logprobs (LossInputs.ref_logprobs is None): "
            "PRIME-RL fills them only when the orchestrator's algorithm scores samples under a "
            "reference (the hinted context of composer's self-teacher). Ship hinted-context "
            'log-probs as ref_logprobs, set sdpo_missing = "skip" to train such samples on the '
            "policy loss only, or set alpha_sdpo = 0."
        )
    with torch.no_grad():
        policy, grad, cols, specs = _policy_terms(s, opts)
        per_token = policy
        if opts.alpha_sdpo > 0 and s.ref_logprobs is not None:
            assert s.has_ref is not None
            distill = _sdpo_terms(s, opts)
            distill = torch.where(s.has_ref, distill, _zero(distill))
            per_token = torch.add(policy, distill, alpha=opts.alpha_sdpo)
            grad = grad.add_(distill, alpha=opts.alpha_sdpo)  # the policy's gradient is a fresh tensor
            cols["sdpo_mask"] = s.mask & s.has_ref
            cols["composer/loss/sdpo"] = distill if s.weights is None else distill * s.weights
            cols["composer/sdpo/reverse_kl_k1"] = s.logprobs - s.ref_logprobs
            specs["composer/loss/sdpo"] = ("composer/loss/sdpo", "sdpo_mask", "sdpo_mask")
            specs["composer/sdpo/reverse_kl_k1"] = ("composer/sdpo/reverse_kl_k1", "sdpo_mask", "sdpo_mask")
        if s.weights is not None:
            per_token = per_token * s.weights
            grad = grad.mul_(s.weights)
        cols["composer/loss/policy"] = policy if s.weights is None else policy * s.weights
        cols["composer/loss/total"] = per_token
        specs["composer/loss/policy"] = ("composer/loss/policy", "mask", "mask")
        specs["composer/loss/total"] = ("composer/loss/total", "mask", "mask")
        cols["mask"] = s.mask
        metrics = _reduce_metrics(cols, specs, _metric_keys(opts))
        if opts.alpha_sdpo > 0:
            skipped = s.mask.any() if s.has_ref is None else s.mask.any() & ~s.has_ref
            metrics["composer/sdpo/skipped"] = skipped.to(torch.float32)
    loss = _with_gradient(inputs.trainer_logprobs, per_token, grad)  # every term is 0 outside the mask
    return LossOutputs(loss=loss, metrics=metrics)


def inputs_has_tokens(s: _Sample) -> bool:
    """Only reached on the error path (channel 2 requested, no ref_logprobs): an empty sample needs none."""
    return bool(s.mask.any())


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
    cols: dict[str, Tensor], specs: dict[str, MetricSpec], keys: tuple[str, ...]
) -> dict[str, Tensor]:
    """Detached float32 0-dim means ``Σ v·w / max(Σ d, 1)`` for ``keys`` from one matmul of the 0/1 (bool)
    columns with every column; a key without a spec (skipped channel) is 0. The columns and specs of a run are
    the same at every call, so which entries of the matmul to read is computed once (:func:`_metric_index`)."""
    names = tuple(cols)
    device = cols["mask"].device
    flags = tuple(cols[n].dtype == torch.bool for n in names)
    present, bools, floats, flat = _metric_index(names, flags, tuple(specs.items()), keys)
    exact = full_precision(device) if torch.is_autocast_enabled(device.type) else contextlib.nullcontext()
    with torch.no_grad(), exact:  # an ambient autocast would run the matmul in bf16: counts past 256 inexact
        # one stack + one cast per kind (a stack of mixed dtypes converts column by column)
        where = torch.stack([cols[n] for n in bools]).to(torch.float32)  # [W, T]
        table = torch.cat((torch.stack([cols[n] for n in floats]).to(torch.float32), where))  # [C, T]
        sums = torch.mm(where, table.T)  # [W, C]: Σ_t where_w · column_c
        num, den = sums.take(_pairs(flat, device)).unbind()  # numerators; denominators (Σ where)
        means = (num / den.clamp(min=1)).unbind() if present else ()
    out = dict(zip(present, means, strict=True))
    if len(out) < len(keys):  # a skipped channel's keys read 0
        zero = torch.zeros((), dtype=torch.float32, device=device)
        out = {k: out.get(k, zero) for k in keys}
    return out


@functools.lru_cache(maxsize=64)
def _metric_index(
    names: tuple[str, ...],
    flags: tuple[bool, ...],
    specs: tuple[tuple[str, MetricSpec], ...],
    keys: tuple[str, ...],
) -> tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...], tuple[int, ...]]:
    """(keys with a spec, the bool columns, the float columns, flat indices into the [W, C] sums: numerators
    then denominators). The table's rows are the float columns then the bool ones, so Σ where·where = Σ where
    (a 0/1 column) gives the denominators from the same matmul."""
    spec = dict(specs)
    present = tuple(k for k in keys if k in spec)
    bools = tuple(n for n, b in zip(names, flags, strict=True) if b)
    floats = tuple(n for n, b in zip(names, flags, strict=True) if not b)
    for _, w, d in spec.values():
        if w not in bools or d not in bools:
            raise TypeError(f"metric columns {w!r} and {d!r} select tokens: they must be bool columns.")
    rows = floats + bools
    width = len(rows)
    num = [bools.index(spec[k][1]) * width + rows.index(spec[k][0]) for k in present]
    den = [bools.index(spec[k][2]) * width + rows.index(spec[k][2]) for k in present]
    return present, bools, floats, tuple(num + den)


@functools.cache
def _pairs(flat: tuple[int, ...], device: torch.device) -> Tensor:
    """``flat`` as a [2, n] index tensor on ``device`` (numerators, denominators), built once per (index,
    device)."""
    return torch.tensor(flat, dtype=torch.long, device=device).view(2, -1)


def _zero(like: Tensor) -> Tensor:
    """A 0-dim zero of ``like``'s dtype and device, made once: ``torch.where(c, x, 0.0)`` dispatches a
    ``scalar_tensor`` per call to make it."""
    return _zero_of(like.dtype, like.device)


@functools.cache
def _zero_of(dtype: torch.dtype, device: torch.device) -> Tensor:
    return torch.zeros((), dtype=dtype, device=device)
