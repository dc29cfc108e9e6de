"""Token-level distillation losses: generalized JSD (full vocabulary, chunked or fused-linear), top-k with a
tail bucket, and the sampled-token reverse-KL estimator.

Generalized JSD (GKD, Agarwal et al., arXiv 2306.13649), TRL's β convention: with student q = softmax(z_S/τ)
and teacher p = softmax(z_T/τ)

- β = 0: forward KL(p‖q) = Σ_v p (log p − log q)  (exact branch)
- β = 1: reverse KL(q‖p) = Σ_v q (log q − log p)  (exact branch)
- 0 < β < 1: m = β·p + (1−β)·q, JSD_β = β·KL(p‖m) + (1−β)·KL(q‖m)  (≤ ln 2 at β = ½)

The teacher is always detached (stop-gradient). The full-vocabulary forms run this module's chunk kernel
(:func:`jsd_kernel`, ``(zs, zt) -> (loss, grad)``) in :mod:`composer_core.loss.engine` (peak O(chunk·V)).
Gradients with respect to the scaled student logits z = z_S/τ:

- FKL: q − p;  RKL: q ⊙ (g − ⟨q, g⟩) with g = log q − log p;
- JSD_β: q ⊙ (g − ⟨q, g⟩) with g = (1−β)(log q − log m)   (∂JSD/∂q_v = (1−β)(log q_v − log m_v)).

The sampled-token form (SDPO, Hübotter et al., arXiv 2601.20802; on-policy distillation, Thinking Machines
2025) needs only the log-probs of the sampled tokens.
"""

from __future__ import annotations

import math
from typing import Literal

import torch
from torch import Tensor

from composer_core.loss.chunking import CHUNK_LOGITS, FUSED_CHUNK_LOGITS, FUSED_MIN_ROWS, chunk_rows
from composer_core.loss.compiled import compiled_jsd_kernel
from composer_core.loss.config import SDPOOptions
from composer_core.loss.engine import (
    Kernel,
    _check_common,
    _compute_dtype,
    _flat_weight,
    full_precision,
    fused_linear_loss,
    logits_loss,
)
from composer_core.loss.validation import (
    as_mask,
    check_bool,
    check_choice,
    check_float,
    check_number,
    check_probability,
    check_same_shape,
)

__all__ = [
    "CHUNK_LOGITS",
    "DEFAULT_CHUNK_SIZE",
    "FUSED_CHUNK_LOGITS",
    "FUSED_MIN_ROWS",
    "Reduction",
    "chunk_rows",
    "full_precision",  # re-exported (PRIME-RL's loss imports it from here)
    "fused_linear_generalized_jsd",
    "generalized_jsd",
    "is_clip_weight",
    "sampled_token_distill",
    "topk_distill",
]

Reduction = Literal["mean", "sum", "none"]

#: ``chunk_size`` default (from :class:`~composer_core.loss.config.SDPOOptions`): None = rows from V
#: (:func:`chunk_rows`).
DEFAULT_CHUNK_SIZE: int | None = SDPOOptions.chunk_size

# ---------------------------------------------------------------------------------------------------------
# Kernels (pure functions of one chunk; no autograd)
# ---------------------------------------------------------------------------------------------------------


def _rowdot(a: Tensor, b: Tensor) -> Tensor:
    """Σ_v a·b per row, via a batched matmul (no [c, V] temporary)."""
    return (a.unsqueeze(-2) @ b.unsqueeze(-1)).reshape(a.shape[:-1])


class Scratch:
    """Reusable [c, V] work buffers of one loss call (a fresh allocation per chunk costs page faults that take
    longer than the arithmetic on CPU). ``get(key, like)`` returns a buffer shaped like ``like`` (rows of a
    larger one when the last chunk is shorter); its contents are garbage."""

    def __init__(self) -> None:
        self._bufs: dict[str, Tensor] = {}

    def get(self, key: str, like: Tensor, dtype: torch.dtype | None = None) -> Tensor:
        dtype = like.dtype if dtype is None else dtype
        buf = self._bufs.get(key)
        wanted = (dtype, like.device, like.shape[1:])
        if buf is None or buf.shape[0] < like.shape[0] or (buf.dtype, buf.device, buf.shape[1:]) != wanted:
            buf = torch.empty(like.shape, dtype=dtype, device=like.device)
            self._bufs[key] = buf
        return buf[: like.shape[0]]


def _log_softmax_and_probs(z: Tensor, logp: Tensor) -> tuple[Tensor, Tensor]:
    """log-softmax of ``z`` into ``logp`` and its exp into ``z`` (two fused passes, no allocation)."""
    torch.log_softmax(z, dim=-1, out=logp)
    torch.exp(logp, out=z)
    return logp, z


def jsd_kernel(beta: float, compiled: bool = SDPOOptions.compiled) -> Kernel:
    """Chunk kernel of the generalized JSD (exact FKL / RKL branches at β = 0 / 1).

    ``compiled=True``: the same formulas under ``torch.compile`` (:mod:`composer_core.loss.compiled`). The eager
    kernel owns (overwrites) its two chunks, returns the gradient in ``zs``'s buffer and reuses two more [c, V]
    buffers (plus a bool one at 0 < β < 1) across the chunks of one loss call.

    Interior β, with d = log q − log p and f = log m − log p = log(β + (1−β)·e^d)
    (= logaddexp(d + log(1−β), log β), forced to exactly 0 where d == 0 so that p == q gives exactly 0):
    KL(p‖m) = −Σ p·f, KL(q‖m) = Σ q·(d − f), ∂JSD/∂z = (1−β)·q ⊙ (g − ⟨q, g⟩) with g = d − f.
    """
    beta = check_probability("beta", beta)
    check_bool("compiled", compiled)
    if compiled:
        return compiled_jsd_kernel(beta)
    scratch = Scratch()
    log_beta = float("-inf") if beta == 0.0 else math.log(beta)
    log_1m_beta = math.log(1.0 - beta) if beta < 1.0 else float("-inf")

    def kernel(zs: Tensor, zt: Tensor) -> tuple[Tensor, Tensor]:
        lq, q = _log_softmax_and_probs(zs, scratch.get("a", zs))
        lp, p = _log_softmax_and_probs(zt, scratch.get("b", zt))
        if beta == 0.0:
            loss = _rowdot(p, lp.sub_(lq))  # Σ p (log p − log q)
            return loss, q.sub_(p)  # q − p
        if beta == 1.0:
            g = lq.sub_(lp)  # log q − log p
            loss = _rowdot(q, g)
            return loss, q.mul_(g.sub_(loss.unsqueeze(-1)))
        d = torch.sub(lq, lp, out=lp)  # log q − log p, in lp's buffer
        f = torch.add(d, log_1m_beta, out=lq)  # lq's buffer is free now
        torch.logaddexp(f, torch.full((), log_beta, dtype=f.dtype, device=f.device), out=f)  # a fill: no copy
        f.masked_fill_(torch.eq(d, 0, out=scratch.get("zero", d, torch.bool)), 0.0)
        kl_p = _rowdot(p, f).neg_()  # KL(p‖m)
        g = d.sub_(f)  # log q − log m
        kl_q = _rowdot(q, g)  # KL(q‖m)
        loss = kl_q.mul(1.0 - beta).add_(kl_p, alpha=beta)
        # (1−β)·g − (1−β)·⟨q, g⟩ in one pass (add's alpha scales g), then q ⊙ ·
        torch.add(kl_q.unsqueeze(-1).mul(beta - 1.0), g, alpha=1.0 - beta, out=g)
        return loss, q.mul_(g)

    return kernel


# ---------------------------------------------------------------------------------------------------------
# Public losses
# ---------------------------------------------------------------------------------------------------------


def generalized_jsd(
    student_logits: Tensor,
    teacher_logits: Tensor,
    *,
    beta: float = SDPOOptions.beta,
    temperature: float = SDPOOptions.temperature,
    mask: Tensor | None = None,
    chunk_size: int | None = DEFAULT_CHUNK_SIZE,
    reduction: Reduction = "mean",
    normalizer: float | Tensor | None = None,
    compiled: bool = SDPOOptions.compiled,
) -> Tensor:
    """Generalized Jensen-Shannon divergence per token (GKD, arXiv 2306.13649; TRL β convention).

    ``β=0``: KL(p_T‖q_S) (forward); ``β=1``: KL(q_S‖p_T) (reverse); else
    ``β·KL(p_T‖m) + (1−β)·KL(q_S‖m)``, ``m = β·p_T + (1−β)·q_S``; p, q = softmax(logits/temperature).

    Args:
        student_logits: [..., V] (gradient flows here).
        teacher_logits: [..., V] (detached).
        mask: [...] bool/0-1 tokens to include (None = all); must select at least one token.
        chunk_size: tokens per chunk (None: :data:`CHUNK_LOGITS` // V); peak extra memory is O(chunk·V) plus the
            [..., V] gradient.
        reduction: ``"mean"`` = Σ_masked / (normalizer or #masked tokens); ``"sum"``; ``"none"`` = [...] with
            0 on masked-out tokens.
        normalizer: global token count (across micro-batches and ranks) for ``"mean"``.
        compiled: run the chunk kernel under ``torch.compile`` (:mod:`composer_core.loss.compiled`; one
            compilation on first use; on a GPU it removes most of the time above the logits' own cost).

    Values and gradients are exact (analytic per-chunk gradients, independent of ``chunk_size``).
    """
    return logits_loss(
        student_logits,
        teacher_logits,
        jsd_kernel(beta, compiled),
        temperature=temperature,
        mask=mask,
        chunk_size=chunk_size,
        reduction=reduction,
        normalizer=normalizer,
    )


def fused_linear_generalized_jsd(
    student_hidden: Tensor,
    lm_head_weight: Tensor,
    teacher_hidden: Tensor,
    *,
    teacher_lm_head_weight: Tensor | None = None,
    lm_head_bias: Tensor | None = None,
    teacher_lm_head_bias: Tensor | None = None,
    beta: float = SDPOOptions.beta,
    temperature: float = SDPOOptions.temperature,
    mask: Tensor | None = None,
    chunk_size: int | None = DEFAULT_CHUNK_SIZE,
    reduction: Literal["mean", "sum"] = "mean",
    normalizer: float | Tensor | None = None,
    compiled: bool = SDPOOptions.compiled,
) -> Tensor:
    """Generalized JSD from hidden states with the LM head fused in (never materialises [N, V]).

    Same loss as :func:`generalized_jsd` on ``student_logits = student_hidden @ lm_head_weightᵀ + lm_head_bias``
    ([N, Hs] @ [V, Hs]ᵀ) and ``teacher_logits = teacher_hidden @ teacher_lm_head_weightᵀ (+ teacher_lm_head_bias)``
    ([N, Ht] @ [V, Ht]ᵀ); only V must match, so the teacher may be a model of another hidden size (as Liger-Kernel's
    ``LigerFusedLinearJSDLoss``). The teacher head defaults to the student's (hinted self-teacher: same network,
    different context; then Ht = Hs). Logits exist only one chunk at a time (Liger-Kernel ``LigerFusedLinearJSD``
    pattern): peak extra memory O(chunk·V + V·(Hs + Ht)). Gradients flow to ``student_hidden``, ``lm_head_weight``
    and ``lm_head_bias``; the teacher side is detached.

    Args:
        student_hidden: [..., Hs]. lm_head_weight: [V, Hs]. lm_head_bias: [V] or None.
        teacher_hidden: [..., Ht] (the same leading dims as ``student_hidden``).
        teacher_lm_head_weight / teacher_lm_head_bias: a separate teacher head [V, Ht] / [V] (default: the
            student's, which needs Ht = Hs).
        chunk_size: tokens per chunk (None: :data:`FUSED_MIN_ROWS`, 256, from V = 32,768 up; see
            :func:`chunk_rows`); the extra memory is about four chunk × V float buffers plus the gradients.
        mask, beta, temperature, normalizer, compiled: as in :func:`generalized_jsd`.
        reduction: ``"mean"`` or ``"sum"``.
    """
    return fused_linear_loss(
        student_hidden,
        lm_head_weight,
        teacher_hidden,
        jsd_kernel(beta, compiled),
        teacher_lm_head_weight=teacher_lm_head_weight,
        lm_head_bias=lm_head_bias,
        teacher_lm_head_bias=teacher_lm_head_bias,
        temperature=temperature,
        mask=mask,
        chunk_size=chunk_size,
        reduction=reduction,
        normalizer=normalizer,
    )


def _log_mixture(lp: Tensor, lq: Tensor, beta: float) -> Tensor:
    """log m with m = β·p + (1−β)·q, computed around the larger of the two log-probs:

    log m = log p + log1p((1−β)·expm1(log q − log p))   where log p ≥ log q, and symmetrically otherwise.

    Unlike ``logaddexp(log p + log β, log q + log(1−β))`` this returns log m == log p **exactly** where
    p == q, so the JSD of identical distributions is exactly 0 (not a rounding residue), value and gradient.
    """
    p_is_hi = lp >= lq
    hi = torch.where(p_is_hi, lp, lq)
    diff = torch.where(p_is_hi, lq - lp, lp - lq)  # ≤ 0
    weight = torch.full_like(lp, beta).masked_fill_(p_is_hi, 1.0 - beta)  # lp's dtype: float64 stays exact
    return hi + torch.log1p(weight * torch.expm1(diff))


def divergence(student_logp: Tensor, teacher_logp: Tensor, beta: float) -> Tensor:
    """Generalized JSD between two log-prob vectors on the last axis (autograd form; small supports)."""
    if beta == 0.0:
        return (teacher_logp.exp() * (teacher_logp - student_logp)).sum(-1)
    if beta == 1.0:
        return (student_logp.exp() * (student_logp - teacher_logp)).sum(-1)
    lm = _log_mixture(teacher_logp, student_logp, beta)
    kl_t = (teacher_logp.exp() * (teacher_logp - lm)).sum(-1)
    kl_s = (student_logp.exp() * (student_logp - lm)).sum(-1)
    return beta * kl_t + (1.0 - beta) * kl_s


def _tail_bucket(logp: Tensor) -> Tensor:
    """Append log(1 − Σ_k p) so the top-k support plus one tail bucket sums to 1."""
    log_s = torch.logsumexp(logp, dim=-1, keepdim=True).clamp(max=-1e-7)
    return torch.cat([logp, torch.log(-torch.expm1(log_s))], dim=-1)


def _reduce(per_token: Tensor, m: Tensor, reduction: str, normalizer: float | Tensor | None) -> Tensor:
    """Reduce a [...] per-token loss under bool mask ``m`` (zeros where masked out)."""
    masked = torch.where(m, per_token, torch.zeros_like(per_token))
    if reduction == "none":
        return masked
    total = masked.sum()
    if reduction == "sum":
        return total
    denom: float | Tensor = m.sum().clamp(min=1).to(per_token.dtype) if normalizer is None else normalizer
    return total / denom


def topk_distill(
    student_logits: Tensor,
    teacher_logits: Tensor,
    *,
    k: int,
    beta: float = SDPOOptions.beta,
    temperature: float = SDPOOptions.temperature,
    mask: Tensor | None = None,
    add_tail_bucket: bool = SDPOOptions.topk_tail,
    support: Literal["student", "teacher"] = "student",
    reduction: Reduction = "mean",
    normalizer: float | Tensor | None = None,
    token_weight: Tensor | None = None,
) -> Tensor:
    """Generalized JSD restricted to a top-k support (TRL ``trl/experimental/sdpo`` ``topk_logits`` mode).

    The support is the top-k tokens of the student (``support="student"``, TRL's choice) or of the teacher.
    True log-probs (normalised over the full vocabulary) are gathered on it; with ``add_tail_bucket`` one extra
    category holds the leftover mass ``1 − Σ_k p`` on each side (so the divergence approximates the
    full-vocabulary one and stays ≥ 0; verl#7856), else both are renormalised over the k tokens.
    Then :func:`generalized_jsd`'s divergence (same ``beta`` convention) on the k(+1) categories, times the
    detached per-token ``token_weight`` [...] when given (SDPO's IS clip, :func:`is_clip_weight`).
    """
    check_float("student_logits", student_logits, min_ndim=2)
    check_float("teacher_logits", teacher_logits)
    check_same_shape("student_logits", student_logits, "teacher_logits", teacher_logits)
    check_probability("beta", beta)
    check_choice("support", support, ("student", "teacher"))
    _check_common(reduction, normalizer, temperature, None)
    vocab = student_logits.shape[-1]
    if isinstance(k, bool) or not isinstance(k, int) or not (1 <= k <= vocab):
        raise ValueError(f"`k`={k!r} must be an int in [1, V={vocab}].")
    m = as_mask(
        "mask",
        mask,
        student_logits.shape[:-1],
        device=student_logits.device,
        require_nonempty=normalizer is None,
    )
    cdtype = _compute_dtype(student_logits.dtype)
    with full_precision(student_logits.device):
        zs = student_logits.to(cdtype) / temperature
        zt = teacher_logits.detach().to(cdtype) / temperature
        source = zs.detach() if support == "student" else zt
        idx = torch.topk(source, k=k, dim=-1).indices
        lq = torch.gather(zs, -1, idx) - torch.logsumexp(zs, dim=-1, keepdim=True)
        lp = torch.gather(zt, -1, idx) - torch.logsumexp(zt, dim=-1, keepdim=True)
        if add_tail_bucket:
            lq, lp = _tail_bucket(lq), _tail_bucket(lp)
        else:
            lq = lq - torch.logsumexp(lq, dim=-1, keepdim=True)
            lp = lp - torch.logsumexp(lp, dim=-1, keepdim=True)
        per_token = divergence(lq, lp, float(beta))
        w = _flat_weight(token_weight, per_token.shape)
        if w is not None:
            per_token = per_token * w.reshape(per_token.shape).to(per_token.dtype)
        return _reduce(per_token, m, reduction, normalizer)


def sampled_token_distill(
    student_logprobs: Tensor,
    teacher_logprobs: Tensor,
    mask: Tensor,
    *,
    old_logprobs: Tensor | None = None,
    is_clip: float | None = SDPOOptions.token_clip,
    reduction: Reduction = "mean",
    normalizer: float | Tensor | None = None,
) -> Tensor:
    """Reverse-KL estimator on the sampled token (SDPO arXiv 2601.20802 / on-policy distillation).

    Per token, with ``d = ℓS − ℓT`` and ``w = min(exp(clamp(ℓS − ℓold, ±20)), is_clip)`` (detached;
    ``w = 1`` when ``old_logprobs`` or ``is_clip`` is None):

    - gradient ``w·sg(d)·∇ℓS``: equal to TRL ``trl/experimental/sdpo`` ``sampled_token`` mode
      (``sg(d)·ℓS`` × clipped IS ratio); on-policy ``E_{y∼q}[d·∇ℓS] = ∇KL(q‖p_T)``.
    - value ``w·d``: the (IS-weighted) k1 estimate of KL(q_S‖p_T), a meaningful number to log (TRL's raw
      surrogate value ``sg(d)·ℓS`` is not).

    Args: ``student_logprobs`` [B, T] (with grad); ``teacher_logprobs`` [B, T] (detached); ``mask`` [B, T].
    """
    check_float("student_logprobs", student_logprobs, min_ndim=1)
    check_float("teacher_logprobs", teacher_logprobs)
    check_same_shape("student_logprobs", student_logprobs, "teacher_logprobs", teacher_logprobs)
    _check_common(reduction, normalizer, 1.0, None)
    if is_clip is not None:
        check_number("is_clip", is_clip, low=0.0, strict=True)
    m = as_mask("mask", mask, student_logprobs.shape, device=student_logprobs.device)
    if old_logprobs is not None:
        check_float("old_logprobs", old_logprobs)
        check_same_shape("student_logprobs", student_logprobs, "old_logprobs", old_logprobs)
    w = is_clip_weight(student_logprobs, old_logprobs, is_clip)
    return _sampled_token_distill(student_logprobs, teacher_logprobs, m, w, reduction, normalizer)


def _sampled_token_distill(
    ls: Tensor,
    teacher_logprobs: Tensor,
    m: Tensor,
    w: Tensor | None,
    reduction: str,
    normalizer: float | Tensor | None,
) -> Tensor:
    """:func:`sampled_token_distill` on validated inputs (``m`` a bool mask, ``w`` the IS-clip weight or None)."""
    d = (ls - teacher_logprobs.detach()).detach()
    per_token = d + d * (ls - ls.detach())
    if w is not None:
        per_token = per_token * w
    return _reduce(per_token, m, reduction, normalizer)


def is_clip_weight(logprobs: Tensor, old_logprobs: Tensor | None, is_clip: float | None) -> Tensor | None:
    """SDPO's importance-sampling clip (TRL ``trl/experimental/sdpo`` ``distillation_is_clip``, lasgroup/SDPO
    ``is_clip``): the detached per-token weight ``w = min(exp(clamp(ℓθ − ℓold, ±20)), is_clip)`` [B, T] that
    multiplies the distillation loss of every form (full, top-k, sampled) on tokens sampled from an older policy
    (``num_iterations > 1``, more generation steps than accumulation steps). None (weight 1) when ``old_logprobs``
    or ``is_clip`` is None. ``logprobs`` / ``old_logprobs``: [B, T] log-probs of the sampled tokens now / at
    sampling."""
    if old_logprobs is None or is_clip is None:
        return None
    with torch.no_grad():
        log_ratio = torch.clamp(logprobs.detach() - old_logprobs.detach(), min=-20.0, max=20.0)
        return torch.exp(log_ratio).clamp(max=is_clip)
