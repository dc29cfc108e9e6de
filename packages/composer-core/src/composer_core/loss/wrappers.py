"""Distillation wrappers: TAID (adaptive interpolated target) and entropy-aware on-policy distillation.

TAID: Temporally Adaptive Interpolated Distillation (Shing et al., SakanaAI, ICLR 2025, arXiv 2501.16937;
reference code ``SakanaAI/TAID`` ``src/distil_losses/taid.py``). Entropy-aware OPD (EOPD): Jin et al.,
arXiv 2603.07079 (formulas as quoted in redai-studio/Relax#244; treat details as unconfirmed).
Both reuse the chunked full-vocabulary engine of :mod:`composer_core.loss.distill` (peak O(chunk·V)).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from composer_core.loss import (
    validation as _validation,  # patched in tests: the kernels look the sync rule up here
)
from composer_core.loss.config import TAID, EntropyOPD, SDPOOptions
from composer_core.loss.distill import (
    DEFAULT_CHUNK_SIZE,
    Reduction,
    Scratch,
    _log_softmax_and_probs,
    _rowdot,
    jsd_kernel,
)
from composer_core.loss.engine import Kernel, logits_loss
from composer_core.loss.validation import check_int, check_number, check_probability

__all__ = ["TAIDScheduler", "entropy_opd_kernel", "entropy_opd_loss", "taid_kernel", "taid_loss"]


def taid_kernel(t: float) -> Kernel:
    """Chunk kernel of TAID: KL(p_t‖q), p_t = softmax((1−t)·sg(z_S) + t·z_T); gradient q − p_t. Owns (overwrites)
    both chunks and returns the gradient in ``zs``'s buffer."""
    scratch = Scratch()

    def kernel(zs: Tensor, zt: Tensor) -> tuple[Tensor, Tensor]:
        target = zt.mul_(t).add_(zs, alpha=1.0 - t)  # (1−t)·z_S + t·z_T, built in the teacher buffer
        lq, q = _log_softmax_and_probs(zs, scratch.get("a", zs))
        lp, p = _log_softmax_and_probs(target, scratch.get("b", target))
        return _rowdot(p, lp.sub_(lq)), q.sub_(p)

    return kernel


def taid_loss(
    student_logits: Tensor,
    teacher_logits: Tensor,
    t: float,
    *,
    temperature: float = SDPOOptions.temperature,
    mask: Tensor | None = None,
    chunk_size: int | None = DEFAULT_CHUNK_SIZE,
    reduction: Reduction = "mean",
    normalizer: float | Tensor | None = None,
) -> Tensor:
    """TAID loss: forward KL(p_t ‖ q_θ) with the logit-space interpolated target (arXiv 2501.16937, eq. 4).

    ``p_t = softmax((1−t)·sg(z_S/τ) + t·z_T/τ)``, ``q_θ = softmax(z_S/τ)``. ``t = 0`` → p_t = q_θ, loss and
    gradient 0; ``t = 1`` → plain forward KL(p_T‖q_θ). The value is the true KL (the reference code logs the
    cross-entropy ``−Σ p_t log q_θ``, which adds H(p_t) but has the same gradient). Use
    :class:`TAIDScheduler` for ``t``. Other arguments as in :func:`composer_core.loss.distill.generalized_jsd`.
    """
    check_probability("t", t)
    return logits_loss(
        student_logits,
        teacher_logits,
        taid_kernel(float(t)),
        temperature=temperature,
        mask=mask,
        chunk_size=chunk_size,
        reduction=reduction,
        normalizer=normalizer,
    )


class TAIDScheduler:
    """Adaptive TAID interpolation parameter t (arXiv 2501.16937, Alg. 1; ``SakanaAI/TAID`` ``TAID.update_t``).

    Call :meth:`step` once per optimiser step, after that step's loss was computed with the current ``t``,
    with the globally reduced (all-ranks, all-micro-batches) loss J of the step — never during validation.
    The first call only records J. Then, at the k-th call (k = 0, 1, … counts the optimiser steps done before
    it, the reference's 0-based ``global_step``)::

        δ = (J_prev − J)/(J_prev + 1e-15);  m = β·m + (1−β)·δ;  Δt = α·sigmoid(m)·(1 − t)
        t = min(t_end, max(t_start + (t_end − t_start)·k/total_steps, t + Δt))

    Which J: the reference feeds the token-mean cross-entropy ``−Σ_v p_t log q_θ`` (= KL + H(p_t));
    :func:`taid_loss` returns the KL, which :class:`composer_trl.ComposerGRPOTrainer` feeds, so t advances faster
    above the linear floor (the floor is the same); feed KL + H(p_t) to reproduce the reference exactly.

    Args: total_steps (optimiser steps of the run), t_start / t_end (default: those of
    :class:`~composer_core.loss.config.TAID`), alpha=5e-4 (α), beta=0.99 (momentum β). State (``t``, momentum,
    previous loss, step) round-trips via state_dict().
    """

    def __init__(
        self,
        total_steps: int,
        t_start: float = TAID.t_start,
        t_end: float = TAID.t_end,
        alpha: float = 5e-4,
        beta: float = 0.99,
    ) -> None:
        check_int("total_steps", total_steps, low=1)
        check_probability("t_start", t_start)
        check_probability("t_end", t_end)
        if t_start > t_end:
            raise ValueError(f"`t_start`={t_start} must not exceed `t_end`={t_end}.")
        check_number("alpha", alpha, low=0.0)
        check_probability("beta", beta, high_open=True)
        self.total_steps = total_steps
        self.t_start = float(t_start)
        self.t_end = float(t_end)
        self.alpha = float(alpha)
        self.beta = float(beta)
        self.t = float(t_start)
        self.momentum = 0.0
        self.prev_loss: float | None = None
        self.num_steps = 0

    def step(self, loss: float | Tensor) -> float:
        """Update t from this optimiser step's reduced loss J and return the new t."""
        if isinstance(loss, Tensor) and loss.numel() != 1:
            raise ValueError(
                f"`loss` must be a scalar (the globally reduced loss), got shape {tuple(loss.shape)}."
            )
        value = float(loss)
        if not math.isfinite(value):
            raise ValueError(f"`loss`={value} is not finite; TAIDScheduler.step needs the reduced loss.")
        done = self.num_steps  # optimiser steps before this one: the reference's 0-based global_step
        self.num_steps += 1
        if self.prev_loss is None:
            self.prev_loss = value
            return self.t
        rel = (self.prev_loss - value) / (self.prev_loss + 1e-15)
        self.momentum = self.beta * self.momentum + (1.0 - self.beta) * rel
        delta_t = self.alpha * (1.0 / (1.0 + math.exp(-self.momentum))) * (1.0 - self.t)
        floor = self.t_start + (self.t_end - self.t_start) * min(done / self.total_steps, 1.0)
        self.t = min(self.t_end, max(floor, self.t + delta_t))
        self.prev_loss = value
        return self.t

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to resume (plain Python values; safe for torch.save/json)."""
        return {key: getattr(self, key) for key in (*_SETTINGS, "t", "momentum", "prev_loss", "num_steps")}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore from :meth:`state_dict`; raises ValueError on missing keys or out-of-range values."""
        missing = {"t", "momentum", "prev_loss", "num_steps"} - set(state)
        if missing:
            raise ValueError(f"TAIDScheduler state is missing {sorted(missing)}; pass state_dict()'s output.")
        t = float(state["t"])
        if not (0.0 <= t <= 1.0):
            raise ValueError(f"TAIDScheduler state has t={t}, outside [0, 1]; the checkpoint is corrupt.")
        for key in _SETTINGS:
            if key in state:
                setattr(self, key, type(getattr(self, key))(state[key]))
        self.t = t
        self.momentum = float(state["momentum"])
        self.prev_loss = None if state["prev_loss"] is None else float(state["prev_loss"])
        self.num_steps = int(state["num_steps"])


#: the constructor's arguments, kept in :meth:`TAIDScheduler.state_dict`
_SETTINGS = ("total_steps", "t_start", "t_end", "alpha", "beta")


def entropy_opd_kernel(beta: float, threshold: float, fkl_weight: float, topk: int | None) -> Kernel:
    """Chunk kernel: JSD_β(q, p) + fkl_weight·1[H(p) > threshold]·FKL_topk(p‖q)."""
    base = jsd_kernel(beta)

    def kernel(zs: Tensor, zt: Tensor) -> tuple[Tensor, Tensor]:
        lp = torch.log_softmax(zt, dim=-1)
        p = lp.exp()
        entropy = -(p * lp).sum(-1)
        gate = (entropy > threshold).to(zs.dtype) * fkl_weight
        extra: tuple[Tensor, Tensor] | None = None
        if not _validation.host_reads_are_free(zs.device) or bool(gate.any()):  # on a GPU: no sync, compute
            lq = torch.log_softmax(zs, dim=-1)
            if topk is None:
                fkl = (p * (lp - lq)).sum(-1)
                g_f = lq.exp_().sub_(p)
            else:
                idx = torch.topk(lp, k=topk, dim=-1).indices
                pk = p.gather(-1, idx)
                fkl = (pk * (lp.gather(-1, idx) - lq.gather(-1, idx))).sum(-1)
                g_f = lq.exp_().mul_(pk.sum(-1, keepdim=True))
                g_f.scatter_add_(-1, idx, -pk)
            extra = (gate * fkl, g_f.mul_(gate.unsqueeze(-1)))
        del lp, p
        loss, grad = base(zs, zt)  # the base kernel overwrites zs / zt: run it last
        if extra is None:
            return loss, grad
        return loss + extra[0], grad.add_(extra[1])

    return kernel


def entropy_opd_loss(
    student_logits: Tensor,
    teacher_logits: Tensor,
    *,
    threshold: float = EntropyOPD.threshold,
    fkl_weight: float = EntropyOPD.weight,
    beta: float = SDPOOptions.beta,
    temperature: float = SDPOOptions.temperature,
    topk: int | None = SDPOOptions.topk,
    mask: Tensor | None = None,
    chunk_size: int | None = DEFAULT_CHUNK_SIZE,
    reduction: Reduction = "mean",
    normalizer: float | Tensor | None = None,
) -> Tensor:
    """Entropy-aware OPD (EOPD, Jin et al., arXiv 2603.07079): base divergence + gated forward KL.

    ``L_t = JSD_β(q_θ, p_T) + fkl_weight · 1[H(p_T) > threshold] · FKL_t``, with
    ``FKL_t = Σ_{v∈S} p_T(v)(log p_T(v) − log q_θ(v))``, S = the teacher's top-``topk`` tokens (truncated,
    not renormalised, as in the paper) or the full vocabulary (``topk=None``). H(p_T) is the full-vocabulary
    teacher entropy in nats (after ``temperature``); the paper's threshold is 0.8 nats. The base divergence
    uses :func:`composer_core.loss.distill.generalized_jsd`'s β convention (β=1: reverse KL, the OPD objective).
    The gate is detached; the added term is normalised by the same token count as the base.
    """
    check_probability("beta", beta)
    check_number("threshold", threshold, low=0.0)
    check_number("fkl_weight", fkl_weight, low=0.0, strict=True)
    vocab = student_logits.shape[-1] if isinstance(student_logits, Tensor) and student_logits.dim() else 0
    if topk is not None and (isinstance(topk, bool) or not isinstance(topk, int) or not (1 <= topk <= vocab)):
        raise ValueError(f"`topk`={topk!r} must be None (full vocabulary) or an int in [1, V={vocab}].")
    return logits_loss(
        student_logits,
        teacher_logits,
        entropy_opd_kernel(float(beta), float(threshold), float(fkl_weight), topk),
        temperature=temperature,
        mask=mask,
        chunk_size=chunk_size,
        reduction=reduction,
        normalizer=normalizer,
    )
