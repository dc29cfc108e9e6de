"""Pairwise preference losses on trace-replay pairs: DPO family and SimPO.

``h = (ℓθ^w − ℓref^w) − (ℓθ^l − ℓref^l)`` with ℓ the **summed** completion log-probs of the chosen (w) and
rejected (l) actions.

- DPO (Rafailov et al., arXiv 2305.18290): ``−log σ(βh)``.
- cDPO (conservative DPO, Mitchell 2023), label smoothing ε: ``−(1−ε)·log σ(βh) − ε·log σ(−βh)``.
- robust DPO (Chowdhury et al., arXiv 2403.00409): ``[−(1−ε)·log σ(βh) + ε·log σ(−βh)] / (1−2ε)``.
- IPO (Azar et al., arXiv 2310.12036): ``(h̄ − 1/(2β))²`` with h̄ from per-token-averaged log-probs (TRL).
- SimPO (Meng et al., arXiv 2405.14734): ``−log σ(β·(ℓ̄θ^w − ℓ̄θ^l) − γ)``, ℓ̄ = ℓ/|y|, no reference model
  (γ is the absolute margin; the paper's γ/β ratio times β).
- RPO's NLL term (iterative RPO, Pang et al., arXiv 2404.19733, Eq. 3), option ``rpo_alpha`` = α of either
  family: each pair's loss gains ``α · (−ℓθ^w / |y_w|)``, the chosen side's length-normalised NLL, as the paper
  writes it per pair. The pairs are then reduced like the rest (Σ / normaliser: the global pair count).
  TRL 1.16 writes RPO as ``DPOConfig(loss_type=["sigmoid", "sft"], loss_weights=[1, α])``, whose ``sft`` term
  is the token mean over the micro-batch's chosen tokens, ``−Σ_p ℓθ^w_p / Σ_p |y_w,p|``: the same value when
  every chosen answer has one length (tested against TRL's DPOTrainer on its own log-probs), a length-weighted average otherwise
  (composer keeps each pair's weight 1/P so accumulation and processes stay exact).
"""

from __future__ import annotations

from typing import Literal

import torch.nn.functional as F
from torch import Tensor

from composer_core.loss.config import DPO, SimPO
from composer_core.loss.engine import _check_common
from composer_core.loss.validation import check_float, check_same_shape, value_check

__all__ = ["dpo_loss", "preference_margin", "simpo_loss"]

#: the options of :func:`dpo_loss` / :func:`simpo_loss` when none are given (frozen: shared instances)
_DEFAULT_DPO = DPO()
_DEFAULT_SIMPO = SimPO()


def _check_pairs(**tensors: Tensor | None) -> int:
    given = [(name, t) for name, t in tensors.items() if t is not None]
    first, ref = given[0]
    for name, t in given:
        check_float(name, t, ndim=1)
        check_same_shape(first, ref, name, t)
    if ref.shape[0] == 0:
        raise ValueError(f"`{first}` holds no preference pair; pass at least one pair or skip the channel.")
    return ref.shape[0]


def _check_lengths(name: str, lengths: Tensor) -> Tensor:
    value_check(
        (name + ":>0", id(lengths)),
        lambda: lengths > 0,
        lambda: f"`{name}` must be > 0 for every pair (token count of each completion).",
    )
    return lengths


def _reduce_pairs(losses: Tensor, reduction: str, normalizer: float | Tensor | None) -> Tensor:
    _check_common(reduction, normalizer, 1.0, None)
    if reduction == "none":
        return losses
    if reduction == "sum":
        return losses.sum()
    return losses.mean() if normalizer is None else losses.sum() / normalizer


def preference_margin(
    chosen_logps: Tensor, rejected_logps: Tensor, ref_chosen_logps: Tensor, ref_rejected_logps: Tensor
) -> Tensor:
    """``h = (ℓθ^w − ℓref^w) − (ℓθ^l − ℓref^l)`` [P] (references detached)."""
    return (chosen_logps - ref_chosen_logps.detach()) - (rejected_logps - ref_rejected_logps.detach())


def _with_nll(losses: Tensor, chosen_logps: Tensor, chosen_lengths: Tensor | None, alpha: float) -> Tensor:
    """``losses + α · (−ℓθ^w / |y_w|)`` [P] (RPO's NLL term; unchanged for α = 0)."""
    if alpha == 0.0:
        return losses
    if chosen_lengths is None:
        raise ValueError(
            "rpo_alpha > 0 needs `chosen_lengths` (the NLL term is per chosen token); pass the token counts."
        )
    lc = _check_lengths("chosen_lengths", chosen_lengths).to(chosen_logps.dtype)
    return losses - alpha * chosen_logps / lc


def dpo_loss(
    chosen_logps: Tensor,
    rejected_logps: Tensor,
    ref_chosen_logps: Tensor,
    ref_rejected_logps: Tensor,
    *,
    options: DPO = _DEFAULT_DPO,
    chosen_lengths: Tensor | None = None,
    rejected_lengths: Tensor | None = None,
    reduction: Literal["mean", "sum", "none"] = "mean",
    normalizer: float | Tensor | None = None,
) -> Tensor:
    """DPO family on summed completion log-probs [P] (see module docstring for the formulas).

    Args:
        chosen_logps / rejected_logps: [P] summed policy log-probs (with grad).
        ref_chosen_logps / ref_rejected_logps: [P] summed reference log-probs (detached).
        options: :class:`~composer_core.loss.config.DPO`, checked when it was built: ``beta`` β (TRL default
            0.1); ``loss_type`` ``"sigmoid"`` (DPO; cDPO when ``label_smoothing > 0``), ``"robust"``, ``"ipo"``;
            ``label_smoothing`` ε ∈ [0, 0.5] for sigmoid, [0, 0.5) for robust, 0 for ipo; ``rpo_alpha`` α ≥ 0,
            the chosen side's NLL term (module docstring).
        chosen_lengths / rejected_lengths: [P] token counts; required by ``"ipo"`` (per-token averages), and
            ``chosen_lengths`` by ``rpo_alpha > 0``.
        reduction / normalizer: ``"mean"`` = Σ / (normalizer or P) — pass the global pair count for
            accumulation-exact gradients; ``"sum"``; ``"none"`` = [P].
    """
    _check_pairs(
        chosen_logps=chosen_logps,
        rejected_logps=rejected_logps,
        ref_chosen_logps=ref_chosen_logps,
        ref_rejected_logps=ref_rejected_logps,
        chosen_lengths=None if chosen_lengths is None else chosen_lengths.to(chosen_logps.dtype),
        rejected_lengths=None if rejected_lengths is None else rejected_lengths.to(chosen_logps.dtype),
    )
    beta, eps = float(options.beta), float(options.label_smoothing)
    if options.loss_type == "ipo":
        if chosen_lengths is None or rejected_lengths is None:
            raise ValueError(
                "loss_type='ipo' needs `chosen_lengths` and `rejected_lengths` (IPO uses per-token-averaged "
                "log-probs, as TRL does); pass the completion token counts."
            )
        lc = _check_lengths("chosen_lengths", chosen_lengths).to(chosen_logps.dtype)
        lr = _check_lengths("rejected_lengths", rejected_lengths).to(chosen_logps.dtype)
        h_bar = (chosen_logps - ref_chosen_logps.detach()) / lc - (
            rejected_logps - ref_rejected_logps.detach()
        ) / lr
        losses = (h_bar - 1.0 / (2.0 * beta)) ** 2
        return _reduce_pairs(_with_nll(losses, chosen_logps, lc, options.rpo_alpha), reduction, normalizer)
    if rejected_lengths is not None or (chosen_lengths is not None and options.rpo_alpha == 0.0):
        raise ValueError(
            f"`chosen_lengths`/`rejected_lengths` are only used by loss_type='ipo' (and `chosen_lengths` by "
            f"rpo_alpha > 0), not {options.loss_type!r}; drop them."
        )
    h = preference_margin(chosen_logps, rejected_logps, ref_chosen_logps, ref_rejected_logps)
    logits = beta * h
    if options.loss_type == "sigmoid":
        losses = -F.logsigmoid(logits) * (1 - eps) - F.logsigmoid(-logits) * eps
    else:
        losses = (-F.logsigmoid(logits) * (1 - eps) + F.logsigmoid(-logits) * eps) / (1 - 2 * eps)
    return _reduce_pairs(
        _with_nll(losses, chosen_logps, chosen_lengths, options.rpo_alpha), reduction, normalizer
    )


def simpo_loss(
    chosen_logps: Tensor,
    rejected_logps: Tensor,
    chosen_lengths: Tensor,
    rejected_lengths: Tensor,
    *,
    options: SimPO = _DEFAULT_SIMPO,
    reduction: Literal["mean", "sum", "none"] = "mean",
    normalizer: float | Tensor | None = None,
) -> Tensor:
    """SimPO (arXiv 2405.14734): ``−log σ(β·(ℓθ^w/|y_w| − ℓθ^l/|y_l|) − γ)`` [P], reference-free; plus
    ``rpo_alpha · (−ℓθ^w/|y_w|)`` per pair when ``options.rpo_alpha > 0`` (RPO's NLL term, module docstring).

    ``options``: :class:`~composer_core.loss.config.SimPO`, checked when it was built; ``gamma`` is the absolute
    target margin γ (= β·``gamma_beta_ratio`` in the SimPO repo; defaults β=2.0, γ=0.5 correspond to the paper's
    γ/β = 0.25). Shapes: every argument [P]. ``reduction``/``normalizer`` as in :func:`dpo_loss`.
    """
    _check_pairs(
        chosen_logps=chosen_logps,
        rejected_logps=rejected_logps,
        chosen_lengths=chosen_lengths.to(chosen_logps.dtype),
        rejected_lengths=rejected_lengths.to(chosen_logps.dtype),
    )
    lc = _check_lengths("chosen_lengths", chosen_lengths).to(chosen_logps.dtype)
    lr = _check_lengths("rejected_lengths", rejected_lengths).to(chosen_logps.dtype)
    logits = float(options.beta) * (chosen_logps / lc - rejected_logps / lr) - float(options.gamma)
    losses = _with_nll(-F.logsigmoid(logits), chosen_logps, lc, options.rpo_alpha)
    return _reduce_pairs(losses, reduction, normalizer)
