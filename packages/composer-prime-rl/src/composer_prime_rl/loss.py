"""``composer_loss``: composer's objective as a PRIME-RL custom rl loss, one sample per call.

PRIME-RL contract (``prime_rl.trainer.rl.loss``): the trainer calls ``fn(inputs, **kwargs)`` once per packed sample
with 1-D per-token tensors and divides the sum of the returned losses by the global rl-token count N (all-reduced
over micro-batches and ranks). So the function returns the **sum** over the sample's masked tokens, never a mean:

    loss_i = Σ_t m_t · w_t · ( L^policy_t + α · L^sdpo_t )

with m = ``loss_mask``, w = ``loss_weights`` (1 when None). Summed over samples and divided by N this is exactly
composer_core's token-level (``loss_type = "dapo"``) policy loss plus α × the sampled-token distillation loss, both
normalised by the same global count.

Channel 1, ``policy_loss = "dppo"`` (PRIME-RL's default, DPPO arXiv 2602.04879 with the Kimi-K2.5 KL of arXiv
2602.02276), with δ = ℓ_train − ℓ_inf, ρ = e^δ, Δp = e^{ℓ_train} − e^{ℓ_inf}:

    masked_t = (A_t > 0 ∧ Δp_t > dppo_mask_high) ∨ (A_t ≤ 0 ∧ Δp_t < −dppo_mask_low)
    L^policy_t = −1[¬masked_t] · adv_tau · A_t · ρ_t + kl_tau · δ_t²

``policy_loss = "clipped_surrogate"`` (PPO, Schulman et al. 2017; GRPO, Shao et al. 2024) with the importance ratio
against the inference engine:

    L^policy_t = −min(ρ_t A_t, clip(ρ_t, 1 − ε_low, 1 + ε_high) A_t)

Channel 2 (``alpha_sdpo > 0``), sampled-token self-distillation (SDPO, arXiv 2601.20802): ``ref_logprobs`` are the
log-probs of the sampled tokens under the same policy given a hint (the self-teacher). Per token the gradient is
``sg(ℓ_train − ℓ_ref) · min(e^{ℓ_train − ℓ_inf}, sdpo_token_clip) · ∇ℓ_train`` (an unbiased reverse-KL(π‖π_hint)
gradient on the sampled tokens; ``composer_core.loss.distill.sampled_token_distill``). Channel 3 (preference
replay) has no per-sample form; :mod:`composer_prime_rl.options` raises if it is requested.
"""

from __future__ import annotations

import contextlib
import functools
import weakref
from collections.abc import Callable
from typing import Any, NamedTuple, cast

import torch
from composer_core.loss.compose import weighted_total
from composer_core.loss.distill import full_precision, sampled_token_distill
from composer_core.loss.policy import clipped_surrogate_from_ratio
from composer_core.loss.validation import value_checks
from torch import Tensor

from composer_prime_rl.contract import LossInputs, LossOutputs
from composer_prime_rl.inputs import (
    _as,
    _bits,
    _bool_mask,
    _check,
    _fields,
    _keep,
    _read,
    _Sample,
    _Suspect,
    _vectorised,
    _zero,
    finite_on_host,
)
from composer_prime_rl.options import PrimeRLLossOptions, parse_options

__all__ = ["composer_loss"]


def _own_mask(unmasked: _Unmasked, raw_mask: Tensor, named: dict[str, Tensor], start: int) -> Tensor:
    """A call's own bool mask, after the value checks of its slice (skipped when clean and the mask bool)."""
    stacked = unmasked.stacked
    mask = _bool_mask(raw_mask, stacked.device)
    if not (unmasked.clean and raw_mask.dtype == torch.bool):
        _check(_keep(mask, stacked[:, start : start + mask.shape[0]]), raw_mask, mask, named)
    return mask


# A metric is Σ_t where·value / max(Σ_t den, 1) over one sample's tokens: (value, where, denominator) columns by
# name, where and denominator bool; a value of None reads 0, a denominator of None 1 (a plain sum: the loss).
MetricSpec = tuple[str | None, str, str | None]


_CLIPPED_METRICS: dict[str, MetricSpec] = {
    "composer/policy/clip_ratio": ("clipped", "mask", "mask"),
    "mismatch_kl": ("mismatch_kl", "mask", "mask"),
}
# PRIME-RL's default_loss_fn metric names and definitions (for A < 0 "masked" is "too low", for A > 0 "too high")
_DPPO_METRICS: dict[str, MetricSpec] = {
    "masked_mismatch_kl": ("mismatch_kl", "dropped", "dropped"),
    "unmasked_mismatch_kl": ("mismatch_kl", "keep", "keep"),
    "is_masked": ("dropped", "mask", "mask"),
    "is_masked_low": ("negative", "dropped", "mask"),
    "is_masked_high": ("positive", "dropped", "mask"),
    "masked_advantage_positive": ("positive", "dropped", "dropped"),
    "masked_advantage_negative": ("negative", "dropped", "dropped"),
}
_BOOL_COLUMNS = frozenset({"clipped", "dropped", "keep", "positive", "negative", "mask", "ref_nonzero"})


def _policy_terms(s: _Sample, opts: PrimeRLLossOptions) -> tuple[Tensor, Tensor, dict[str, Tensor]]:
    """Channel 1 per token [seq], detached and zero outside the mask: (loss, ∂loss/∂ℓ_train written out, the
    columns its metrics read)."""
    log_ratio = s.logprobs - s.inference_logprobs  # 0 outside the mask (both zeroed)
    ratio = torch.exp(log_ratio)
    mismatch_kl = ratio - log_ratio - 1.0  # k3 estimate of KL(π_inf‖π_train)
    policy = opts.config.policy
    if opts.policy_loss == "clipped_surrogate":
        eps_lo, eps_hi = policy.epsilons
        per_token, is_clipped = clipped_surrogate_from_ratio(
            ratio, s.advantages, eps_lo, eps_hi, policy.delta
        )
        grad = _clipped_grad(ratio, s.advantages, eps_lo, eps_hi, policy.delta)
        return per_token, grad, {"clipped": is_clipped, "mismatch_kl": mismatch_kl}

    # DPPO (composer_core.loss.policy.dppo_loss, PRIME-RL's default_loss_fn). |Δp| < 1, so a bound above 1 masks
    # nothing (options.py reads one as 1). L = c·ρ + κ·δ² with c = −adv_tau·A on kept tokens (0 on dropped ones), so
    # ∂L/∂ℓ = c·ρ + 2κ·δ.
    low, high = policy.dppo_mask_low, policy.dppo_mask_high
    prob_diff = torch.exp(s.logprobs).sub_(torch.exp(s.inference_logprobs))  # Δp
    positive, negative = s.advantages > 0, s.advantages < 0
    if _vectorised(s.mask):
        dropped = ((positive & (prob_diff > high)) | (~positive & (prob_diff < -low))) & s.mask
        keep = s.mask ^ dropped
        kept_adv = s.advantages * _bits(keep)  # A is finite (0 outside the mask)
    else:
        dropped = torch.where(positive, prob_diff > high, prob_diff < -low) & s.mask
        keep = s.mask ^ dropped
        kept_adv = torch.where(keep, s.advantages, _zero(ratio))
    coef_ratio = kept_adv.mul_(-opts.adv_tau).mul_(ratio)  # c·ρ
    per_token = torch.addcmul(coef_ratio, log_ratio, log_ratio, value=opts.kl_tau)
    grad = torch.add(coef_ratio, log_ratio, alpha=2.0 * opts.kl_tau)
    cols = dict(dropped=dropped, keep=keep, positive=positive, negative=negative, mismatch_kl=mismatch_kl)
    return per_token, grad, cols


def _clipped_grad(ratio: Tensor, adv: Tensor, eps_lo: float, eps_hi: float, delta: float | None) -> Tensor:
    """∂/∂ℓ of ``−min(a, b)``, ``a = ρ'·A``, ``b = clip(ρ, 1 − ε_lo, 1 + ε_hi)·A``, ρ' = min(ρ, δ), exactly as
    autograd differentiates it (clamp passes the gradient on its closed interval, ``min`` gives a tie half to each
    side, ∂ρ/∂ℓ = ρ), branch-free in float arithmetic:

        ∂/∂ℓ = −ρ · A · 1[ρ ≤ δ] · share,  share = 1 + (sign(b − a) − |sign(clip(ρ) − ρ)|) / 2

    ``share`` is the unclipped side's part of the min's gradient: 1 inside the clip range (a = b, two equal
    derivatives); outside it 1 where a < b, 1/2 on a tie, 0 where a > b."""
    clip = torch.clamp(ratio, 1 - eps_lo, 1 + eps_hi)
    lhs = ratio if delta is None else ratio.clamp(max=delta)
    side = torch.mul(clip, adv).sub_(lhs * adv).sign_()  # sign(b − a)
    outside = clip.sub_(ratio).sign_().abs_()  # 0 in [1 − ε_lo, 1 + ε_hi], else 1
    share = side.sub_(outside).mul_(0.5).add_(1.0)
    if delta is not None:  # ∂ρ'/∂ρ = 1[ρ ≤ δ] = 1 − sign(ρ − ρ') (ρ ≥ ρ')
        share.mul_(lhs.sub_(ratio).sign_().add_(1.0))  # ρ' − ρ ≤ 0
    return share.mul_(adv).mul_(ratio).neg_()


def _sdpo_terms(s: _Sample, opts: PrimeRLLossOptions) -> Tensor:
    """Channel 2 per token [seq], detached, zero outside the mask (``sampled_token_distill``): the value
    w·(ℓ − ℓ_ref) is also its gradient coefficient (the k1 surrogate). Core's value checks are off: this module
    runs its own per sample (:func:`_passes`)."""
    assert s.ref_logprobs is not None
    with value_checks(enabled=False):
        return sampled_token_distill(
            s.logprobs[None], s.ref_logprobs[None], s.mask[None], old_logprobs=s.inference_logprobs[None],
            is_clip=opts.config.sdpo.token_clip, reduction="none",
        )[0]  # fmt: skip


class _Unmasked(NamedTuple):
    """Fresh masks: packed float fields whose masks are not views (under an rl weight stream PRIME-RL passes
    ``loss_mask = mask & (rl_weights != 0)``, a new tensor). Every column is computed once over every token; each
    call checks its slice and zeroes it outside its own mask before the matmul (``torch.where``, or when ``clean``
    a product of the rows that select tokens), and backward zeroes its slice of the derivative."""

    stacked: Tensor  # [F, N] the packed fields (each call's value checks read its slice)
    clean: bool  # every packed value and table entry is finite (known on CPU only)
    unmasked_rows: Tensor | None  # [C, 1] bool: the rows no call's mask touches (ref_nonzero), None if none


class _Packed(NamedTuple):
    """Everything per token that one micro-batch's samples share, computed once over the packed tensors they
    are views of (PRIME-RL's train loop passes ``packed.squeeze().split(sequence_lengths)``), or over one
    sample's own tensors. A sample then costs one matmul over its slice.

    Variants: with channel 2 on, a sample whose ``ref_logprobs`` are PRIME-RL's zero fill is trained without it:
    ``picks`` holds both readings of every metric (with its teacher, without), then the sample's selector, and its
    gradient is ``grads @ selector`` (channel 1 in column 0, channel 2's share in column 1)."""

    key: tuple[Any, ...]  # (options, field names, version counters)
    bases: tuple[weakref.ref[Tensor], ...]  # what every field (and the mask) is a view of
    length: int  # tokens of the packed tensors
    where: Tensor  # [W, N] the bool columns that select or count tokens: the table's last rows
    table: Tensor  # [C, N] every column in one dtype (see _plan)
    picks: Tensor  # [2, V·(K + 1) (+ 2)]: numerators, denominators: flat indices into the [W, C] sums
    grads: Tensor  # [N] ∂loss/∂ℓ_train per token; with variants [N, 2]: channel 1's, channel 2's share
    keys: tuple[str, ...]  # the K metric keys (then come the loss and the selector)
    suspect: _Suspect | None
    unmasked: _Unmasked | None  # fresh masks: each call brings its own


class _Last:
    """The micro-batch being trained (one slot: PRIME-RL calls every sample of a micro-batch before the next);
    it refers to the packed tensors weakly."""

    packed: _Packed | None = None
    table: Tensor | None = None  # the packed table's memory, reused by the next micro-batch of its shape


def _layout(tensors: tuple[Tensor, ...]) -> tuple[tuple[Tensor, ...], int, int] | None:
    """(the bases, the sample's first token in them, their size) when all are 1-D views at one offset of
    contiguous tensors of one size (PRIME-RL's ``split`` of packed ``[1, N]`` tensors); else None."""
    bases: list[Tensor] = []
    start = size = -1
    for t in tensors:
        b = t._base
        if b is None or t.stride() != (1,) or not b.is_contiguous():
            return None
        offset = int(t.storage_offset() - b.storage_offset())
        if not bases:
            start, size = offset, int(b.numel())
        elif offset != start or b.numel() != size:
            return None
        bases.append(b)
    return tuple(bases), start, size


def _shared(opts: PrimeRLLossOptions, raw_mask: Tensor, named: dict[str, Tensor]) -> tuple[_Packed, int]:
    """The micro-batch this sample belongs to (computed on its first sample, matched by identity and version
    counter) and the sample's first token in it. A mask that is not a view like the float fields is each call's
    own (:class:`_Unmasked`); float fields that are not packed views make a micro-batch of their own."""
    layout = _layout(tuple(named.values()))
    if layout is None:
        return _pack(opts, raw_mask, named), 0
    bases, start, size = layout
    mask_layout = _layout((raw_mask,))
    mask_bases = mask_layout[0] if mask_layout is not None and mask_layout[1:] == (start, size) else ()
    fresh = not mask_bases
    bases += mask_bases
    tensors = (*named.values(), *(() if fresh else (raw_mask,)))
    key = (opts, tuple(named), tuple(t._version for t in tensors), fresh)
    last = _Last.packed
    if (
        last is not None
        and last.key == key
        and all(ref() is b for ref, b in zip(last.bases, bases, strict=True))
    ):
        return last, start
    flat = [b.detach().view(-1) for b in bases]
    refs = tuple(weakref.ref(b) for b in bases)
    floats = dict(zip(named, flat[: len(named)], strict=True))
    _Last.packed = None  # that micro-batch is done: the next one reuses its table's memory
    _Last.packed = _pack(opts, None if fresh else flat[-1], floats, key, refs)
    return _Last.packed, start


def _pack(
    opts: PrimeRLLossOptions,
    raw_mask: Tensor | None,
    named: dict[str, Tensor],
    key: tuple[Any, ...] = (),
    bases: tuple[weakref.ref[Tensor], ...] = (),
) -> _Packed:
    """Every per-token column and gradient over the given tensors; ``raw_mask`` None: :class:`_Unmasked`."""
    s, stacked, suspect = _read(raw_mask, named)
    cfg = opts.config
    policy, grad, cols = _policy_terms(s, opts)
    w = s.weights
    cols["mask"] = s.mask
    cols["composer/loss/policy"] = policy if w is None else policy * w
    # core's weighted_total weights the channels, per token: their values and their derivatives (a sample sums the
    # channels it has: channel 2 only with a teacher, see _Packed)
    weights = (cfg.alpha_sdpo, cfg.beta_replay, cfg.w_policy)
    grads = [weighted_total(grad, None, None, *weights)]
    if cfg.w_policy != 1.0:  # the weighted policy term is the loss of a sample without a teacher
        alone = weighted_total(policy, None, None, *weights)
        cols["weighted_policy"] = alone if w is None else alone * w
    if cfg.alpha_sdpo > 0 and s.ref_logprobs is not None:
        assert s.ref_nonzero is not None
        distill = _sdpo_terms(s, opts)  # its value is also its derivative (the k1 surrogate)
        total = weighted_total(policy, distill, None, *weights)
        cols["composer/loss/total"] = total if w is None else total * w
        cols["composer/loss/sdpo"] = distill if w is None else distill * w
        cols["composer/sdpo/reverse_kl_k1"] = s.logprobs - s.ref_logprobs
        cols["ref_nonzero"] = s.ref_nonzero
        grads.append(weighted_total(None, distill, None, *weights))
    keys, columns, width, flat = _plan(opts, tuple(cols))
    dtype = torch.float64 if s.logprobs.dtype == torch.float64 else torch.float32
    table = _table(
        [None if c is None else cols[c] for c in columns], s.mask.shape[0], dtype, s.mask.device, bool(key)
    )
    if w is not None:
        grads = [g * w for g in grads]
    unmasked = None
    if raw_mask is None:
        floats = table[: columns.index(None)]  # the bool rows are finite
        # clean: every packed value and table entry finite, known by one host read on CPU only
        clean = finite_on_host(stacked, floats)
        unmasked = _Unmasked(stacked, clean, _unmasked_rows(columns, s.mask.device))
    return _Packed(
        key=key,
        bases=bases,
        length=s.logprobs.shape[0],
        where=table[-width:],
        table=table,
        picks=_pairs(flat, s.logprobs.device),
        grads=grads[0] if len(grads) == 1 else torch.stack(grads, dim=1),
        keys=keys,
        suspect=suspect,
        unmasked=unmasked,
    )


def _table(
    columns: list[Tensor | None], n: int, dtype: torch.dtype, device: torch.device, reuse: bool
) -> Tensor:
    """[C, N] ``columns`` in ``dtype`` (None: zeros), each written and converted in place (one pass per column).
    ``reuse``: a packed micro-batch's, written into the last one's memory when the shape matches (a fresh [C, N]
    costs a page fault per 4 KiB on CPU, more than the copies)."""
    table = _Last.table if reuse else None
    if table is None or table.shape != (len(columns), n) or table.dtype != dtype or table.device != device:
        table = torch.empty((len(columns), n), dtype=dtype, device=device)
        _Last.table = table if reuse else _Last.table
    for row, column in zip(table.unbind(), columns, strict=True):
        row.zero_() if column is None else row.copy_(_bits(column))
    return table


def _sample_row(packed: _Packed, start: int, n: int, mask: Tensor | None) -> tuple[Tensor, Tensor | None]:
    """One sample's K metric means then its loss (a sum) and its gradient selector [2] (None without variants):
    one matmul of its slice of the bool columns with every column, one gather, one division. ``mask``: the call's
    own (fresh masks), which first zeroes its slice of the table outside it."""
    where, table = packed.where, packed.table
    cut = n != packed.length
    unmasked = packed.unmasked
    rows = None if unmasked is None else unmasked.unmasked_rows
    if mask is not None and unmasked is not None and not unmasked.clean:  # fresh masks, not all finite
        # zero this call's slice of the table outside its own mask; the where rows are its last rows
        part = table[:, start : start + n] if cut else table
        table = torch.where(mask if rows is None else rows | mask, part, _zero(table))
        where = table[table.shape[0] - where.shape[0] :]
    else:
        if cut:
            where, table = where[:, start : start + n], table[:, start : start + n]
        if mask is not None:  # fresh masks, all finite: the rows that select tokens suffice (x × 0 = 0)
            where = where * (mask if rows is None else rows[-where.shape[0] :] | mask)
    sums = torch.mm(where, table.T)  # [W, C]: Σ_t where_w · column_c
    num, den = sums.take(packed.picks).unbind()
    means = num.div_(den.clamp_(min=1))
    if packed.grads.dim() == 1:
        return means, None
    width = len(packed.keys) + 1
    selector = means[-2:]
    return torch.where(selector[1] > 0, means[:width], means[width : 2 * width]), selector


def _exact(device: torch.device) -> contextlib.AbstractContextManager[None]:
    """Full precision under an ambient autocast (a bf16 matmul counts inexactly past 256)."""
    return full_precision(device) if torch.is_autocast_enabled(device.type) else contextlib.nullcontext()


class _SampleLoss(torch.autograd.Function):
    """A sample's loss as a function of ``trainer_logprobs`` whose gradient is the sample's slice of the packed
    per-token derivative (no autograd graph of the formula)."""

    @staticmethod
    def forward(
        ctx: Any,
        logprobs: Tensor,
        loss: Tensor,
        grads: Tensor,
        selector: Tensor | None,
        start: int,
        n: int,
        mask: Tensor | None,
    ) -> Tensor:
        selector = None if selector is None else _as(selector, grads.device, grads.dtype)
        ctx.save_for_backward(grads, selector, mask)
        ctx.cut = None if n == grads.shape[0] else slice(start, start + n)
        return loss.to(logprobs.dtype, copy=True)

    @staticmethod
    def backward(ctx: Any, grad_output: Tensor) -> tuple[Tensor | None, ...]:
        grads, selector, mask = ctx.saved_tensors
        if ctx.cut is not None:
            grads = grads[ctx.cut]
        if mask is not None:  # fresh masks: the packed derivative covers every token
            grads = torch.where(mask if grads.dim() == 1 else mask[:, None], grads, _zero(grads))
        none = (None,) * 6
        if selector is None:
            return grads * grad_output, *none
        with _exact(grads.device):
            return torch.mv(grads, selector).mul_(grad_output), *none


_sample_loss = cast(Callable[..., Tensor], _SampleLoss.apply)


def composer_loss(inputs: LossInputs, **kwargs: Any) -> LossOutputs:
    """composer's loss for one PRIME-RL sample: ``[trainer.loss] import_path = "composer_prime_rl.composer_loss"``.

    Args:
        inputs: PRIME-RL's ``LossInputs`` for one sample (1-D tensors of equal length): ``trainer_logprobs``
            (grad), ``inference_logprobs``, ``ref_logprobs`` (or its pre-0be5ac45 name ``teacher_logprobs``),
            ``advantages``, ``loss_mask``, ``loss_weights`` (optional).
        **kwargs: ``[trainer.loss.kwargs]``; see :class:`composer_prime_rl.options.PrimeRLLossOptions`
            (validated once per distinct kwargs, then a cache lookup).

    Returns:
        ``LossOutputs`` with ``loss`` = the SUM over masked tokens of
        ``w_t (w_policy L^policy_t + alpha_sdpo L^sdpo_t)``
        (PRIME-RL divides by the global token count) and 0-dim detached float32 ``metrics``:
        ``composer/loss/policy``, ``composer/loss/sdpo`` and ``composer/loss/total`` (per-token means of this
        sample), the policy diagnostics (PRIME-RL's DPPO names, or ``composer/policy/clip_ratio`` +
        ``mismatch_kl``), and with channel 2 on ``composer/sdpo/reverse_kl_k1`` and ``composer/sdpo/skipped``.
        Every call of a run emits the same keys. When the fields are views of packed tensors (PRIME-RL's train
        loop), every per-token term and value check runs once per micro-batch and each sample costs one matmul
        over its slice. A sample whose ``loss_mask`` selects no token returns an exact 0 still attached to the
        graph and zero metrics.

    Raises:
        ValueError: bad kwargs (:func:`composer_prime_rl.options.parse_options`), a field that is not a 1-D tensor
            of the sample's length, a non-boolean mask, NaN/inf on masked tokens, or channel 2 on without
            ``ref_logprobs`` (None) while ``sdpo_missing = "error"`` (all-zero ``ref_logprobs``, PRIME-RL's packer
            fill, skip channel 2). On an accelerator the value checks are device asserts with the same messages,
            raised at the next synchronisation.
    """
    opts = parse_options(kwargs)
    raw_mask, named = _fields(inputs, opts.config.alpha_sdpo > 0)
    n = raw_mask.shape[0]
    with torch.no_grad(), _exact(named["trainer_logprobs"].device):
        packed, start = _shared(opts, raw_mask, named)
        if (suspect := packed.suspect) is not None:  # a packed check failed: this sample rechecks its slice
            cut = slice(start, start + n)
            named_cut = {name: t[cut] for name, t in suspect.named.items()}
            _check(suspect.kept[:, cut], suspect.raw_mask[cut], suspect.mask[cut], named_cut)
        mask = None if packed.unmasked is None else _own_mask(packed.unmasked, raw_mask, named, start)
        row, selector = _sample_row(packed, start, n, mask)
    if (
        opts.config.alpha_sdpo > 0
        and "ref_logprobs" not in named
        and opts.sdpo_missing == "error"
        and bool((raw_mask != 0).any())  # only reached without ref_logprobs: an empty sample needs none
    ):
        raise ValueError(
            "alpha_sdpo > 0 but this sample has no ref_logprobs (LossInputs.ref_logprobs is None): "
            "PRIME-RL fills them only when the orchestrator's algorithm scores samples under a "
            "reference (the hinted context of composer's self-teacher). Ship hinted-context "
            'log-probs as ref_logprobs, set sdpo_missing = "skip" to train such samples on the '
            "policy loss only, or set alpha_sdpo = 0."
        )
    values = row.unbind()  # the K metrics, the loss (and the selector without variants)
    k = len(packed.keys)
    loss = _sample_loss(inputs.trainer_logprobs, values[k], packed.grads, selector, start, n, mask)
    if row.dtype != torch.float32:
        values = row.to(torch.float32).unbind()
    return LossOutputs(loss=loss, metrics=dict(zip(packed.keys, values[:k], strict=True)))


@functools.lru_cache(maxsize=64)
def _plan(
    opts: PrimeRLLossOptions, names: tuple[str, ...]
) -> tuple[tuple[str, ...], tuple[str | None, ...], int, tuple[int, ...]]:
    """(the metric keys, the table's columns, W, flat indices into the [W, C] sums: every variant's K metrics and
    loss then the selector, numerators then denominators) for the columns ``names`` of a run. Columns: the float
    ones, an all-zero one (None), the bool ones only read as values, then the W bool ones that select or count
    tokens (the where rows), so Σ where·where = Σ where gives the denominators from the same matmul."""
    policy = _DPPO_METRICS if opts.policy_loss == "dppo" else _CLIPPED_METRICS
    keys: tuple[str, ...] = (
        *policy,
        "composer/loss/policy",
        "composer/loss/total",
    )  # every call of a run emits the same keys
    if opts.config.alpha_sdpo > 0:
        keys += ("composer/loss/sdpo", "composer/sdpo/reverse_kl_k1", "composer/sdpo/skipped")
    weighted = "composer/loss/policy" if opts.config.w_policy == 1.0 else "weighted_policy"  # w_policy·policy
    alone = policy | {
        "composer/loss/policy": ("composer/loss/policy", "mask", "mask"),
        "composer/loss/total": (weighted, "mask", "mask"),
        "composer/sdpo/skipped": ("mask", "mask", "mask"),  # 1 when the sample has a token, else 0
        "loss": (weighted, "mask", None),
    }
    variants = [alone]
    if "ref_nonzero" in names:  # channel 2 on, with ref_logprobs: with its teacher (0) or the zero fill (1)
        with_ref = alone | {
            "composer/loss/total": ("composer/loss/total", "mask", "mask"),
            "composer/loss/sdpo": ("composer/loss/sdpo", "mask", "mask"),
            "composer/sdpo/reverse_kl_k1": ("composer/sdpo/reverse_kl_k1", "mask", "mask"),
            "composer/sdpo/skipped": (None, "mask", None),
            "loss": ("composer/loss/total", "mask", None),
        }
        variants = [with_ref, alone]
    entries = [v.get(k, (None, "mask", None)) for v in variants for k in (*keys, "loss")]
    if len(variants) > 1:  # the selector: Σ f / max(Σ f, 1) is 1 if any, else 0
        entries += [("mask", "mask", "mask"), ("ref_nonzero", "ref_nonzero", "ref_nonzero")]
    # the bool columns that select (where) or count (denominator) tokens, in first-use order
    rows = tuple(dict.fromkeys(n for _, w, d in entries for n in (w, d) if n is not None))
    floats = tuple(n for n in names if n not in _BOOL_COLUMNS)
    columns = (*floats, None, *(n for n in names if n in _BOOL_COLUMNS and n not in rows), *rows)
    width = len(columns)
    for value, w, d in entries:
        if value not in columns or not {w, d} - {None} <= _BOOL_COLUMNS:
            raise TypeError(
                f"metric spec {(value, w, d)!r}: no such column, or a where/denominator not bool."
            )
    num = [rows.index(w) * width + columns.index(v) for v, w, _ in entries]
    den = [rows.index(d or w) * width + columns.index(d) for _, w, d in entries]
    return keys, columns, len(rows), tuple(num + den)


@functools.cache
def _unmasked_rows(columns: tuple[str | None, ...], device: torch.device) -> Tensor | None:
    """[C, 1] bool: the table rows a call's own mask leaves whole (:class:`_Unmasked`), None if none."""
    flags = [c == "ref_nonzero" for c in columns]
    return torch.tensor(flags, device=device)[:, None] if any(flags) else None


@functools.cache
def _pairs(flat: tuple[int, ...], device: torch.device) -> Tensor:
    """``flat`` as a [2, n] index tensor (numerators, denominators) on ``device``, built once."""
    return torch.tensor(flat, dtype=torch.long, device=device).view(2, -1)
