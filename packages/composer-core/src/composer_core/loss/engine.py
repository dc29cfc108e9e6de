"""The full-vocabulary engine of the token-level distillation losses: chunk kernels
``(zs [c, V], zt [c, V]) -> (per-row loss [c], ∂loss/∂zs [c, V])`` (:data:`Kernel`) run by one chunked autograd
Function on [N, V] logits (:func:`logits_loss`) and one fused one that builds the logits from hidden states and
the LM head chunk by chunk (:func:`fused_linear_loss`; Liger-Kernel ``LigerFusedLinearJSD`` pattern).

Each chunk's value and exact analytic gradient are computed in the forward pass, so peak extra memory is
O(chunk·V) and the backward pass is a rescale. The kernels: :func:`composer_core.loss.distill.jsd_kernel`
(generalized JSD), :mod:`composer_core.loss.compiled` (the same under ``torch.compile``) and the TAID / entropy-OPD
kernels of :mod:`composer_core.loss.wrappers`.
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Callable, Iterable, Iterator
from typing import Any, cast

import torch
from torch import Tensor

from composer_core.loss.chunking import check_chunk_size, chunk_rows
from composer_core.loss.validation import (
    as_mask,
    check_choice,
    check_float,
    check_normalizer,
    check_number,
    check_same_shape,
    check_tensor,
    checked_once,
    host_reads_are_free,
    value_check,
)

__all__ = ["Kernel", "full_precision", "fused_linear_loss", "logits_loss"]

#: A per-chunk kernel: (scaled student logits [c, V], scaled teacher logits [c, V]) ->
#: (per-row loss [c], gradient of the per-row loss w.r.t. the scaled student logits [c, V]).
Kernel = Callable[[Tensor, Tensor], tuple[Tensor, Tensor]]


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


def full_precision(device: torch.device) -> contextlib.AbstractContextManager[Any]:
    """Autocast off for ``device``'s type: under an ambient ``torch.autocast`` (TRL ``bf16=True``, FSDP mixed
    precision) the kernels' matmuls would run in bf16/fp16; every loss here computes in ``promote(input dtype,
    float32)`` and returns gradients in the inputs' dtypes instead."""
    if torch.amp.is_autocast_available(device.type):
        return torch.autocast(device_type=device.type, enabled=False)
    return contextlib.nullcontext()


def _first_non_finite(named: Iterable[tuple[str, Tensor | None]]) -> str | None:
    """The name of the first given tensor holding NaN/inf (searched only once a check has failed)."""
    return next((n for n, t in named if t is not None and not bool(torch.isfinite(t).all())), None)


def _non_finite_message(names: tuple[str, str], chunks: tuple[Tensor, Tensor]) -> str:
    culprit = _first_non_finite(zip(names, chunks)) or " / ".join(names)
    return (
        f"`{culprit}` contains NaN/inf values; fix the upstream computation (mask padded positions with a "
        "finite value, not -inf/NaN) before calling the loss."
    )


def _head_message(heads: Iterable[tuple[str, Tensor | None]]) -> str:
    culprit = _first_non_finite(heads)
    if culprit is not None:
        return f"`{culprit}` contains NaN/inf values; fix the weights (reload them from a finite checkpoint)."
    return (
        "the logits computed from `student_hidden`/`teacher_hidden` and the LM head overflow to NaN/inf; check "
        "the hidden states and head weights (or compute in float32)."
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
        # needs_input_grad is False for a None bias
        grad_b = torch.zeros(weight.shape[0], dtype=cdtype, device=device) if need_b else None
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
        # a non-finite row (or head entry: it reaches every row's logits) makes the sum non-finite: one check per
        # call; the heads, not scanned up front, are searched only on failure
        heads = (("lm_head_weight", weight), ("lm_head_bias", bias), ("teacher_lm_head_weight", teacher_weight),
                 ("teacher_lm_head_bias", teacher_bias))  # fmt: skip
        value_check(None, lambda: torch.isfinite(total), lambda: _head_message(heads))
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


def _check_common(
    reduction: str,
    normalizer: float | Tensor | None,
    temperature: float,
    chunk_size: int | None,
    allowed: tuple[str, ...] = ("mean", "sum", "none"),
) -> None:
    """The arguments the losses share (a ``normalizer`` only with ``reduction="mean"``; a loss without a temperature
    or chunks passes 1.0 and None)."""
    check_number("temperature", temperature, low=0.0, strict=True)
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
    _check_common(reduction, normalizer, temperature, chunk_size)
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
    _check_common(reduction, normalizer, temperature, chunk_size, ("mean", "sum"))
    check_float("student_hidden", student_hidden, min_ndim=2)
    check_float("teacher_hidden", teacher_hidden, min_ndim=2)
    check_float("lm_head_weight", lm_head_weight, ndim=2, values=False)  # NaN/inf: the loss total's check
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
    vocab = lm_head_weight.shape[0]
    t_weight = lm_head_weight if teacher_lm_head_weight is None else teacher_lm_head_weight
    if teacher_lm_head_weight is not None:
        check_float("teacher_lm_head_weight", teacher_lm_head_weight, ndim=2, values=False)
    if t_weight.shape != (vocab, t_hidden):
        raise ValueError(
            f"`teacher_hidden` (hidden size Ht = {t_hidden}) needs a teacher head of shape [V, Ht] = [{vocab}, "
            f"{t_hidden}] (V of `lm_head_weight`), but `teacher_lm_head_weight` (default: `lm_head_weight`) has "
            f"shape {tuple(t_weight.shape)}; pass the teacher's own head as `teacher_lm_head_weight`."
        )
    for name, b in (("lm_head_bias", lm_head_bias), ("teacher_lm_head_bias", teacher_lm_head_bias)):
        if b is not None:
            check_float(name, b, ndim=1, values=False)
            if b.shape[0] != vocab:
                raise ValueError(f"`{name}` has {b.shape[0]} entries; it must have V = {vocab}.")
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
        chunk_rows(chunk_size, vocab, fused=True),
        scale,
        _flat_weight(token_weight, token_shape),
    )
