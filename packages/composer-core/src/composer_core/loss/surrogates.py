"""Per-token surrogates of the GRPO-family loss types beyond the PPO clip: CISPO, SAPO, VESPO (LUSPO is the clip
surrogate with a per-sequence sum), and GSPO's sequence-level importance ratio.

References: CISPO (MiniMax-M1, arXiv 2506.13585); SAPO (soft adaptive policy optimisation, arXiv 2511.20347);
VESPO (gamma-weighted sequence ratio); LUSPO (length-unbiased sequence policy optimisation); GSPO (arXiv
2507.18071). The op order of each function is TRL 1.16 ``GRPOTrainer._compute_loss``'s, so an adapter
reproduces TRL bit-exactly. Shapes: B sequences, T completion tokens; ``ρ`` is ``[B, T]`` (token level) or
``[B, 1]`` (sequence level); ``A`` is ``[B, 1]`` or ``[B, T]``.
"""

from __future__ import annotations

import math
from typing import Literal

import torch
from torch import Tensor

ISLevel = Literal["token", "sequence"]
IS_LEVELS: tuple[str, ...] = ("token", "sequence")

_LOG_EPS = math.log(1e-8)  # VESPO's clamp floor in log space (its authors' 1e-8)


def log_importance_weights(log_ratio: Tensor, m: Tensor, level: str) -> Tensor:
    """``log ρ``: the token log-ratio ``ℓθ − ℓold`` [B, T], or GSPO's length-normalised sequence log-ratio
    ``Σ_t (ℓθ − ℓold)·m / max(Σ_t m, 1)`` as [B, 1]. ``m``: float mask [B, T]."""
    if level == "token":
        return log_ratio
    return ((log_ratio * m).sum(-1) / m.sum(-1).clamp(min=1.0)).unsqueeze(-1)


def cispo_surrogate(coef_1: Tensor, adv: Tensor, logprobs: Tensor, epsilon_high: float) -> Tensor:
    """CISPO: ``L_t = −sg(min(ρ, ε_hi))·A·ℓθ`` (the ratio is clipped and detached; the gradient is REINFORCE's)."""
    clamped = torch.clamp(coef_1, max=epsilon_high).detach()
    return -clamped * adv * logprobs


def sapo_surrogate(coef_1: Tensor, adv: Tensor, temperature_pos: float, temperature_neg: float) -> Tensor:
    """SAPO: ``L_t = −σ(τ·(ρ − 1))·4/τ · A`` with ``τ = τ_pos`` where ``A > 0`` else ``τ_neg`` (a soft clip)."""
    tau = torch.where(adv > 0, temperature_pos, temperature_neg)
    return -(torch.sigmoid(tau * (coef_1 - 1)) * 4 / tau) * adv


@torch.no_grad()
def vespo_weights(
    adv: Tensor,
    log_ratio: Tensor,
    m: Tensor,
    is_weights: Tensor | None,
    k_pos: float,
    lambda_pos: float,
    k_neg: float,
    lambda_neg: float,
) -> Tensor:
    """VESPO's detached gamma weight per sequence, [B, 1]: ``φ(w) = e^{λ}·w^{k}·e^{−λw}`` (``φ(1) = 1``) of the
    sequence ratio ``w = exp(clamp(Σ_t clamp(ℓθ − ℓold, ±20)·m + Σ_t log(IS weight), log 1e-8, 20))``;
    ``(k, λ) = (k_pos, λ_pos)`` where ``A ≥ 0``, else ``(k_neg, λ_neg)``. Non-finite φ → 0.
    The loss is ``L_t = −φ·A·ℓθ``."""
    seq_log_ratio = torch.sum(torch.clamp(log_ratio, -20.0, 20.0) * m, dim=-1, keepdim=True)
    if is_weights is not None:
        seq_log_ratio += torch.sum(torch.clamp(torch.log(is_weights), _LOG_EPS, 20.0), dim=-1, keepdim=True)
    log_w = torch.clamp(seq_log_ratio, _LOG_EPS, 20.0)
    w = torch.exp(log_w)
    nonneg = adv >= 0
    k = torch.where(nonneg, k_pos, k_neg)
    lam = torch.where(nonneg, lambda_pos, lambda_neg).clamp(min=1e-4)
    return torch.exp(lam + k * log_w - lam * w).nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)
