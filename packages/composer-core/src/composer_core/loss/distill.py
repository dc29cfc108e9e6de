"""Token-level distillation losses: generalized JSD (full vocabulary, chunked or fused-linear), top-k with a
tail bucket, and the sampled-token reverse-KL estimator.

Generalized JSD (GKD, Agarwal et al., arXiv 2306.13649), TRL's β convention: with student q = softmax(z_S/τ)
and teacher p = softmax(z_T/τ)

- β = 0: forward KL(p‖q) = Σ_v p (log p − log q)  (exact branch)
- β = 1: reverse KL(q‖p) = Σ_v q (log q − log p)  (exact branch)
- 0 < β < 1: m = β·p + (1−β)·q, JSD_β = β·KL(p‖m) + (1−β)·KL(q‖m)  (≤ ln 2 at β = ½)

The teacher is always detached (stop-gradient). The full-vocabulary forms never hold more than
``chunk_size × V`` of intermediate values: a custom :class:`torch.autograd.Function` computes each chunk's value
and its exact analytic gradient during the forward pass (Liger-Kernel style), so the backward pass is a
rescale. Gradients with respect to the scaled student logits z = z_S/τ:

- FKL: q − p;  RKL: q ⊙ (g − ⟨q, g⟩) with g = log q − log p;
- JSD_β: q ⊙ (g − ⟨q, g⟩) with g = (1−β)(log q − log m)   (∂JSD/∂q_v = (1−β)(log q_v − log m_v)).

The sampled-token form (SDPO, Hübotter et al., arXiv 2601.20802; on-policy distillation, Thinking Machines
2025) needs only the log-probs of the sampled tokens.
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Callable, Iterator
from typing import Any, Literal, cast

import torch
from torch import Tensor

from composer_core.loss.chunking import (
    CHUNK_LOGITS,
    FUSED_CHUNK_LOGITS,
    FUSED_MIN_ROWS,
    check_chunk_size,
    chunk_rows,
)
from composer_core.loss.config import SDPOOptions
from composer_core.loss.validation import (
    as_mask,
    check_bool,
    check_choice,
    check_float,
    check_normalizer,
    check_positive,
    check_probability,
    check_same_shape,
    check_tensor,
    checked_once,
    value_check,
)
from composer_core.loss.validation import (  # re-exported: the kernels and wrappers look it up here
    host_reads_are_free as host_reads_are_free,
)

__all__ = [
    "CHUNK_LOGITS",
    "DEFAULT_CHUNK_SIZE",
    "FUSED_CHUNK_LOGITS",
    "FUSED_MIN_ROWS",
    "Reduction",
    "chunk_rows",
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

#: A per-chunk kernel: (scaled student logits [c, V], scaled teacher logits [c, V]) ->
#: (per-row loss [c], gradient of the per-row loss w.r.t. the scaled student logits [c, V]).
Kernel = Callable[[Tensor, Tensor], tuple[Tensor, Tensor]]


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
        if (
            buf is None
            or buf.dtype != dtype
            or buf.device != like.device
            or buf.shape[1:] != like.shape[1:]
            or buf.shape[0] < like.shape[0]
        ):
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
    if compiled:
        from composer_core.loss.compiled import compiled_jsd_kernel

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
# Chunked engines
# ---------------------------------------------------------------------------------------------------------


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


def full_precision(device: torch.device) -> contextlib.AbstractContextManager[Any]:
    """Autocast off for ``device``'s type: under an ambient ``torch.autocast`` (TRL ``bf16=True``, FSDP mixed
    precision) the kernels' matmuls would run in bf16/fp16; every loss here computes in ``promote(input dtype,
    float32)`` and returns gradients in the inputs' dtypes instead."""
    if torch.amp.is_autocast_available(device.type):
        return torch.autocast(device_type=device.type, enabled=False)
    return contextlib.nullcontext()


def _non_finite_message(names: tuple[str, str], chunks: tuple[Tensor, Tensor]) -> str:
    culprits = [n for n, c in zip(names, chunks) if not bool(torch.isfinite(c).all())] or [" / ".join(names)]
    return (
        f"`{culprits[0]}` contains NaN/inf values; fix the upstream computation (mask padded positions with a "
        "finite value, not -inf/NaN) before calling the loss."
    )


def _in_full_precision(forward: Callable[..., Tensor]) -> Callable[..., Tensor]:
    """Run an autograd Function's ``forward(ctx, first_tensor, ...)`` with autocast off for that tensor's device."""

    @functools.wraps(forward)
    def wrapper(ctx: Any, first: Tensor, *args: Any) -> Tensor:
        with full_precision(first.device):
            return forward(ctx, first, *args)

    return wrapper


Selector = Tensor | slice


def _chunks(rows: Tensor, n_rows: int, chunk_size: int) -> Iterator[tuple[Selector, Tensor | None, int]]:
    """``(selector, keep, count)`` per chunk of the selected rows.

    ``rows`` is either the int64 indices of the selected rows (chosen on the host: masked rows cost nothing)
    or, on an accelerator, the bool [N] row mask itself: every row is computed in contiguous slices and the
    masked ones are zeroed (``keep``), so no shape depends on data and nothing waits for the device.
    """
    if rows.dtype == torch.bool:
        for start in range(0, n_rows, chunk_size):
            stop = min(start + chunk_size, n_rows)
            yield slice(start, stop), rows[start:stop], stop - start
        return
    for start in range(0, rows.numel(), chunk_size):
        idx = rows[start : start + chunk_size]
        yield idx, None, idx.numel()


def _chunk_width(rows: Tensor, n_rows: int, chunk_size: int) -> int:
    selected = n_rows if rows.dtype == torch.bool else rows.numel()
    return min(chunk_size, max(selected, 1))


def _rows_into(src: Tensor, sel: Selector, out: Tensor) -> Tensor:
    """``src[sel]`` in ``out``'s dtype, written into ``out`` (one copy; no allocation when dtypes match)."""
    if isinstance(sel, slice):
        return out.copy_(src[sel])
    if src.dtype == out.dtype:
        return torch.index_select(src, 0, sel, out=out)
    return out.copy_(src.index_select(0, sel))


def _put(dst: Tensor, sel: Selector, value: Tensor) -> None:
    """``dst[sel] = value`` (cast to ``dst``'s dtype)."""
    if isinstance(sel, slice):
        dst[sel].copy_(value)
    else:
        dst.index_copy_(0, sel, value if value.dtype == dst.dtype else value.to(dst.dtype))


def _factor(scale: float | Tensor, temperature: float, dtype: torch.dtype) -> float | Tensor:
    """``scale / temperature`` as the gradient's multiplier: a Python float, or a device scalar in ``dtype``
    (an accelerator's ``1 / count``), rounded once to ``dtype`` either way, as a Python scalar is."""
    if isinstance(scale, Tensor):
        return (scale / temperature).to(dtype)
    return scale / temperature


def _times(total: Tensor, scale: float | Tensor) -> Tensor:
    return total * (scale.to(total.dtype) if isinstance(scale, Tensor) else scale)


def _run_kernel(
    kernel: Kernel, zs: Tensor, zt: Tensor, temperature: float, keep: Tensor | None
) -> tuple[Tensor, Tensor]:
    """``kernel`` on one chunk of logits (scaled by ``1/temperature`` in place); the loss and gradient of the rows
    ``keep`` drops are zeroed (accelerator path; NaN-safe)."""
    if temperature != 1.0:
        zs.div_(temperature)
        zt.div_(temperature)
    loss, grad = kernel(zs, zt)
    if keep is None:
        return loss, grad
    grad.masked_fill_(~keep.unsqueeze(-1), 0.0)
    return torch.where(keep, loss, 0.0), grad


def _times_grad_out(grad: Tensor, grad_out: Tensor) -> Tensor:
    """``grad · grad_out`` (a backward's chain rule), skipped for the usual ``grad_out`` of 1 read on the host."""
    if host_reads_are_free(grad_out.device) and bool(grad_out == 1):
        return grad
    return grad * grad_out.to(grad.dtype)


def _weighted(loss: Tensor, grad: Tensor, weight: Tensor | None, sel: Selector) -> Tensor:
    """A chunk's per-row ``loss`` times its rows of the detached per-token ``weight`` [N] (None: 1), the gradient
    ``grad`` scaled in place to match."""
    if weight is None:
        return loss
    w = weight[sel].to(loss.dtype)
    grad.mul_(w.unsqueeze(-1))
    return loss * w


class _ChunkedLogitsLoss(torch.autograd.Function):
    """Σ_rows scale·loss(row) (or per-row losses) over given rows of [N, V] logits, chunk by chunk."""

    @staticmethod
    @_in_full_precision
    def forward(
        ctx: Any,
        student: Tensor,
        teacher: Tensor,
        rows: Tensor,
        kernel: Kernel,
        temperature: float,
        chunk_size: int,
        scale: float | Tensor,
        per_row: bool,
        weight: Tensor | None,
    ) -> Tensor:
        cdtype = _compute_dtype(student.dtype)
        n_rows, vocab = student.shape
        grad = torch.zeros_like(student)
        per_row_out = torch.zeros(n_rows, dtype=cdtype, device=student.device) if per_row else None
        total = torch.zeros((), dtype=cdtype, device=student.device)
        buf_s = torch.empty(
            _chunk_width(rows, n_rows, chunk_size), vocab, dtype=cdtype, device=student.device
        )
        buf_t = torch.empty_like(buf_s)
        factor = _factor(1.0 if per_row else scale, temperature, cdtype)
        for sel, keep, c in _chunks(rows, n_rows, chunk_size):
            zs = _rows_into(student, sel, buf_s[:c])
            loss, g = _run_kernel(kernel, zs, _rows_into(teacher, sel, buf_t[:c]), temperature, keep)
            loss = _weighted(loss, g, weight, sel)
            if isinstance(factor, Tensor) or factor != 1.0:
                g.mul_(factor)
            _put(grad, sel, g)
            if per_row_out is not None:
                _put(per_row_out, sel, loss)
            else:
                total += loss.sum()
        # one value check per call (joins compose_loss's fused check): a NaN/inf logit makes its row's loss
        # non-finite; only on failure are the selected rows searched for the culprit
        result = total if per_row_out is None else per_row_out
        value_check(
            None,
            lambda: torch.isfinite(result),
            lambda: _non_finite_message(("student_logits", "teacher_logits"), (student[rows], teacher[rows])),
        )
        ctx.save_for_backward(grad)
        ctx.per_row = per_row
        if per_row_out is not None:
            return per_row_out
        return _times(total, scale)

    @staticmethod
    def backward(ctx: Any, *grad_outputs: Tensor) -> tuple[Tensor | None, ...]:
        (grad,) = ctx.saved_tensors
        grad_out = grad_outputs[0]
        with full_precision(grad.device):
            if ctx.per_row:
                g = grad * grad_out.to(grad.dtype).unsqueeze(-1)
            else:
                g = _times_grad_out(grad, grad_out)
        return g, None, None, None, None, None, None, None, None


class _FusedLinearLoss(torch.autograd.Function):
    """Σ_rows scale·loss(row) with logits built one chunk at a time: student ``hidden [N, Hs] @ W [V, Hs]ᵀ (+ b)``,
    teacher ``teacher_hidden [N, Ht] @ teacher_weight [V, Ht]ᵀ (+ teacher_bias)`` (Ht may differ from Hs)."""

    @staticmethod
    @_in_full_precision
    def forward(
        ctx: Any,
        student_hidden: Tensor,
        weight: Tensor,
        bias: Tensor | None,
        teacher_hidden: Tensor,
        teacher_weight: Tensor,
        teacher_bias: Tensor | None,
        rows: Tensor,
        kernel: Kernel,
        temperature: float,
        chunk_size: int,
        scale: float | Tensor,
        token_weight: Tensor | None,
    ) -> Tensor:
        cdtype = _compute_dtype(student_hidden.dtype)
        device = student_hidden.device
        need_h, need_w, need_b = ctx.needs_input_grad[0], ctx.needs_input_grad[1], ctx.needs_input_grad[2]
        grad_h = torch.zeros_like(student_hidden) if need_h else None
        grad_w = torch.zeros(weight.shape, dtype=cdtype, device=weight.device) if need_w else None
        grad_b = (
            torch.zeros(weight.shape[0], dtype=cdtype, device=device)
            if (need_b and bias is not None)
            else None
        )
        w_c = weight.detach().to(cdtype)
        same_head = teacher_weight is weight or (
            teacher_weight.shape == weight.shape and teacher_weight.data_ptr() == weight.data_ptr()
        )
        tw_c = w_c if same_head else teacher_weight.to(cdtype)
        tb_c = None if teacher_bias is None else teacher_bias.to(cdtype)
        b_c = None if bias is None else bias.detach().to(cdtype)
        total = torch.zeros((), dtype=cdtype, device=device)
        factor = _factor(scale, temperature, cdtype)
        width = _chunk_width(rows, student_hidden.shape[0], chunk_size)
        hidden = student_hidden.shape[1]
        buf_hs = torch.empty(width, hidden, dtype=cdtype, device=device)
        # the teacher's hidden size Ht may differ from the student's Hs
        buf_ht = torch.empty(width, teacher_hidden.shape[1], dtype=cdtype, device=device)
        buf_s = torch.empty(width, weight.shape[0], dtype=cdtype, device=device)
        buf_t = torch.empty_like(buf_s)
        buf_gh = torch.empty_like(buf_hs) if grad_h is not None else None
        for sel, keep, c in _chunks(rows, student_hidden.shape[0], chunk_size):
            hs = _rows_into(student_hidden, sel, buf_hs[:c])
            zs = torch.matmul(hs, w_c.T, out=buf_s[:c])
            zt = torch.matmul(_rows_into(teacher_hidden, sel, buf_ht[:c]), tw_c.T, out=buf_t[:c])
            if b_c is not None:
                zs.add_(b_c)
            if tb_c is not None:
                zt.add_(tb_c)
            loss, g = _run_kernel(kernel, zs, zt, temperature, keep)
            total += _weighted(loss, g, token_weight, sel).sum()
            # the factor scales the [c, H] operands and the [V] sum, not a pass over g [c, V]
            if grad_h is not None and buf_gh is not None:
                _put(grad_h, sel, torch.matmul(g, w_c, out=buf_gh[:c]).mul_(factor))
            if grad_w is not None:
                grad_w.addmm_(g.T, hs.mul_(factor))
            if grad_b is not None:
                grad_b.add_(g.sum(0).mul_(factor))
        value_check(  # a non-finite row makes the sum non-finite: one check per call
            None,
            lambda: torch.isfinite(total),
            lambda: (
                "the logits computed from `student_hidden`/`teacher_hidden` and the LM head overflow to "
                "NaN/inf; check the hidden states and head weights (or compute in float32)."
            ),
        )
        ctx.save_for_backward(
            *(t if t is not None else torch.empty(0) for t in (grad_h, grad_w, grad_b)),
        )
        ctx.has = (grad_h is not None, grad_w is not None, grad_b is not None)
        ctx.dtypes = (student_hidden.dtype, weight.dtype, bias.dtype if bias is not None else weight.dtype)
        return _times(total, scale)

    @staticmethod
    def backward(ctx: Any, *grad_outputs: Tensor) -> tuple[Tensor | None, ...]:
        grad_out = grad_outputs[0]
        with full_precision(grad_out.device):
            outs = [
                _times_grad_out(g, grad_out).to(dtype) if has else None
                for has, g, dtype in zip(ctx.has, ctx.saved_tensors, ctx.dtypes)
            ]
        return (*outs, None, None, None, None, None, None, None, None, None)


_apply_chunked = cast(Callable[..., Tensor], _ChunkedLogitsLoss.apply)
_apply_fused = cast(Callable[..., Tensor], _FusedLinearLoss.apply)


# ---------------------------------------------------------------------------------------------------------
# Shared argument handling
# ---------------------------------------------------------------------------------------------------------


def _check_common(
    temperature: float,
    chunk_size: int | None,
    reduction: str,
    normalizer: float | Tensor | None,
    allowed: tuple[str, ...],
) -> None:
    check_positive("temperature", temperature)
    check_chunk_size("chunk_size", chunk_size)
    check_choice("reduction", reduction, allowed)
    check_normalizer("normalizer", normalizer)
    if normalizer is not None and reduction != "mean":
        raise ValueError(f"`normalizer` only applies to reduction='mean', not {reduction!r}.")


def _rows_and_scale(
    mask: Tensor | None,
    token_shape: torch.Size,
    device: torch.device,
    reduction: str,
    normalizer: float | Tensor | None,
) -> tuple[Tensor, float | Tensor]:
    """``(rows, scale)``: the selected rows (see :func:`_chunks`) and the mean's ``1 / count``, folded into the
    kernel's float32 gradient before it is stored in the inputs' dtype (one rounding for a bf16 gradient).

    On the host the rows are selected by index and counted. On an accelerator ``rows`` is the bool row mask and
    the count stays a device tensor, as does a tensor normaliser: nothing waits for the device.
    """
    if mask is None:  # every row: counted on the host, nothing to select or zero
        rows = torch.arange(math.prod(token_shape), device=device)
    else:
        # an empty mask is a zero contribution when a global normaliser counts tokens elsewhere
        m = as_mask("mask", mask, token_shape, device=device, require_nonempty=normalizer is None).reshape(-1)
        rows = m.nonzero().squeeze(-1) if host_reads_are_free(device) else m
    if reduction != "mean":
        return rows, 1.0
    exact = torch.float32 if device.type == "mps" else torch.float64  # MPS has no float64
    if isinstance(normalizer, Tensor):  # kept where it is: a 0-dim CPU tensor joins a GPU op as a scalar
        return rows, normalizer.to(exact).reciprocal()
    if normalizer is not None:
        return rows, 1.0 / float(normalizer)
    if rows.dtype != torch.bool:
        return rows, 1.0 / float(max(rows.numel(), 1))
    return rows, rows.sum().clamp(min=1).to(exact).reciprocal()


def _flat_weight(weight: Tensor | None, token_shape: torch.Size) -> Tensor | None:
    if weight is None:
        return None
    check_float("token_weight", weight)
    if weight.shape != token_shape:
        raise ValueError(
            f"`token_weight` has shape {tuple(weight.shape)}; it must be the tokens' shape {tuple(token_shape)}."
        )
    return weight.detach().reshape(-1)


@checked_once
def logits_loss(
    student_logits: Tensor,
    teacher_logits: Tensor,
    kernel: Kernel,
    *,
    temperature: float,
    mask: Tensor | None,
    chunk_size: int | None,
    reduction: str,
    normalizer: float | Tensor | None,
    token_weight: Tensor | None = None,
) -> Tensor:
    """Check the shared arguments, then run a chunk ``kernel`` over [..., V] logits with masking and reduction
    (the logits-input losses: :func:`generalized_jsd`, ``taid_loss``, ``entropy_opd_loss``). ``token_weight``
    [...]: a detached per-token factor of the loss and its gradient (SDPO's IS clip, :func:`is_clip_weight`)."""
    _check_common(temperature, chunk_size, reduction, normalizer, ("mean", "sum", "none"))
    check_tensor("student_logits", student_logits, min_ndim=2)
    check_tensor("teacher_logits", teacher_logits, min_ndim=2)
    check_same_shape("student_logits", student_logits, "teacher_logits", teacher_logits)
    if not student_logits.is_floating_point() or not teacher_logits.is_floating_point():
        raise ValueError("`student_logits` and `teacher_logits` must be floating-point tensors.")
    token_shape = student_logits.shape[:-1]
    rows, scale = _rows_and_scale(mask, token_shape, student_logits.device, reduction, normalizer)
    vocab = student_logits.shape[-1]
    s = student_logits.reshape(-1, vocab)
    t = teacher_logits.detach().reshape(-1, vocab)
    chunk = chunk_rows(chunk_size, vocab, fused=False)
    w = _flat_weight(token_weight, token_shape)
    out = _apply_chunked(s, t, rows, kernel, float(temperature), chunk, scale, reduction == "none", w)
    return out.reshape(token_shape) if reduction == "none" else out


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
    check_probability("beta", beta)
    check_bool("compiled", compiled)
    return logits_loss(
        student_logits,
        teacher_logits,
        jsd_kernel(float(beta), compiled),
        temperature=temperature,
        mask=mask,
        chunk_size=chunk_size,
        reduction=reduction,
        normalizer=normalizer,
    )


@checked_once
def fused_linear_loss(
    student_hidden: Tensor,
    lm_head_weight: Tensor,
    teacher_hidden: Tensor,
    kernel: Kernel,
    *,
    teacher_lm_head_weight: Tensor | None,
    lm_head_bias: Tensor | None,
    teacher_lm_head_bias: Tensor | None,
    temperature: float,
    mask: Tensor | None,
    chunk_size: int | None,
    reduction: str,
    normalizer: float | Tensor | None,
    token_weight: Tensor | None = None,
) -> Tensor:
    """Run a chunk ``kernel`` on logits built chunk-wise from hidden states (shared by the wrappers); ``token_weight``
    as in :func:`logits_loss`.

    Student ``student_hidden [..., Hs]`` with ``lm_head_weight [V, Hs]``; teacher ``teacher_hidden [..., Ht]`` with
    ``teacher_lm_head_weight [V, Ht]`` (Ht may differ from Hs; without a teacher head, Ht must equal Hs)."""
    _check_common(temperature, chunk_size, reduction, normalizer, ("mean", "sum"))
    check_float("student_hidden", student_hidden, min_ndim=2)
    check_float("teacher_hidden", teacher_hidden, min_ndim=2)
    check_float("lm_head_weight", lm_head_weight, ndim=2)
    if teacher_hidden.shape[:-1] != student_hidden.shape[:-1]:
        raise ValueError(
            f"`teacher_hidden` has shape {tuple(teacher_hidden.shape)} but `student_hidden` has shape "
            f"{tuple(student_hidden.shape)}; their leading dims (the tokens) must match."
        )
    hidden, t_hidden = student_hidden.shape[-1], teacher_hidden.shape[-1]
    if lm_head_weight.shape[1] != hidden:
        raise ValueError(
            f"`lm_head_weight` has shape {tuple(lm_head_weight.shape)} but must be [V, H] with H = "
            f"{hidden} (the hidden size of `student_hidden`)."
        )
    t_weight = lm_head_weight if teacher_lm_head_weight is None else teacher_lm_head_weight
    if teacher_lm_head_weight is None and t_hidden != hidden:
        raise ValueError(
            f"`teacher_hidden` has shape {tuple(teacher_hidden.shape)}: hidden size {t_hidden}, not the student's "
            f"{hidden}; without `teacher_lm_head_weight` the teacher uses `lm_head_weight` [V, {hidden}]. Pass "
            f"the teacher's own head as `teacher_lm_head_weight` [V, {t_hidden}]."
        )
    if teacher_lm_head_weight is not None:
        check_float("teacher_lm_head_weight", teacher_lm_head_weight, ndim=2)
        if teacher_lm_head_weight.shape[0] != lm_head_weight.shape[0]:
            raise ValueError(
                f"`teacher_lm_head_weight` has shape {tuple(teacher_lm_head_weight.shape)} but `lm_head_weight` has "
                f"shape {tuple(lm_head_weight.shape)}; their vocabulary sizes V (dim 0) must match."
            )
        if teacher_lm_head_weight.shape[1] != t_hidden:
            raise ValueError(
                f"`teacher_hidden` has hidden size {t_hidden} but `teacher_lm_head_weight` has shape "
                f"{tuple(teacher_lm_head_weight.shape)}; it must be [V, Ht] with Ht = {t_hidden}."
            )
    for name, b in (("lm_head_bias", lm_head_bias), ("teacher_lm_head_bias", teacher_lm_head_bias)):
        if b is not None:
            check_float(name, b, ndim=1)
            if b.shape[0] != lm_head_weight.shape[0]:
                raise ValueError(
                    f"`{name}` has {b.shape[0]} entries; it must have V = {lm_head_weight.shape[0]}."
                )
    t_bias = teacher_lm_head_bias
    if t_bias is None and teacher_lm_head_weight is None:
        t_bias = lm_head_bias  # same head for the (self-)teacher
    token_shape = student_hidden.shape[:-1]
    rows, scale = _rows_and_scale(mask, token_shape, student_hidden.device, reduction, normalizer)
    return _apply_fused(
        student_hidden.reshape(-1, hidden),
        lm_head_weight,
        lm_head_bias,
        teacher_hidden.detach().reshape(-1, t_hidden),
        t_weight.detach(),
        None if t_bias is None else t_bias.detach(),
        rows,
        kernel,
        float(temperature),
        chunk_rows(chunk_size, lm_head_weight.shape[0], fused=True),
        scale,
        _flat_weight(token_weight, token_shape),
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
    check_probability("beta", beta)
    check_bool("compiled", compiled)
    return fused_linear_loss(
        student_hidden,
        lm_head_weight,
        teacher_hidden,
        jsd_kernel(float(beta), compiled),
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
    weight = torch.full_like(lp, beta).masked_fill_(
        p_is_hi, 1.0 - beta
    )  # in lp's dtype (float64 stays exact)
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
    _check_common(temperature, 1, reduction, normalizer, ("mean", "sum", "none"))
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
    check_choice("reduction", reduction, ("mean", "sum", "none"))
    check_normalizer("normalizer", normalizer)
    if normalizer is not None and reduction != "mean":
        raise ValueError(f"`normalizer` only applies to reduction='mean', not {reduction!r}.")
    if is_clip is not None:
        check_positive("is_clip", is_clip)
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
