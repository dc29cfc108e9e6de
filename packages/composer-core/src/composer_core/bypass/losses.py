"""Block-output losses of bypass distillation (Puzzle, arXiv 2411.19146, Sec. 3).

Every loss compares a student block's output ``x`` with the teacher block's output ``y``
(both ``[..., H]``), normalised by the teacher output's energy so that blocks with large
residual streams do not dominate and a student equal to the teacher scores exactly 0.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor


def _check(x: Tensor, y: Tensor, eps: float) -> None:
    if x.shape != y.shape:
        raise ValueError(f"student output shape {tuple(x.shape)} != teacher output shape {tuple(y.shape)}")
    if x.dim() < 2:
        raise ValueError(f"block outputs need at least 2 dims [..., hidden], got shape {tuple(x.shape)}")
    if eps < 0:
        raise ValueError(f"eps must be >= 0, got {eps}")


def _finite(loss: Tensor, x: Tensor, y: Tensor) -> Tensor:
    """Raise instead of returning NaN/inf (one scalar check; NaN/inf anywhere in x or y reaches the loss)."""
    if not torch.isfinite(loss.detach()):
        culprit = "teacher block output" if not torch.isfinite(y).all() else "student block output"
        raise ValueError(f"{culprit} contains NaN/inf (loss {float(loss)}): check weights, inputs and lr")
    return loss


def normalized_mse(x: Tensor, y: Tensor, eps: float = 1e-8) -> Tensor:
    """``mse(x, y) / (mse(y, 0) + eps) = Σ(x−y)² / (Σy² + N·eps)`` over every element.

    Puzzle's block loss (NVIDIA Model-Optimizer ``normalized_mse_loss``).
    """
    _check(x, y, eps)
    return _finite((x - y).pow(2).mean() / (y.pow(2).mean() + eps), x, y)


def vectorwise_normalized_mse(x: Tensor, y: Tensor, eps: float = 1e-8) -> Tensor:
    """Mean over token vectors of ``‖x_t − y_t‖² / (‖y_t‖² + eps)`` (each hidden vector normalised alone)."""
    _check(x, y, eps)
    return _finite(((x - y).pow(2).sum(-1) / (y.pow(2).sum(-1) + eps)).mean(), x, y)


def per_sample_normalized_mse(x: Tensor, y: Tensor, eps: float = 1e-8) -> Tensor:
    """Mean over samples (dim 0) of ``Σ(x_b−y_b)² / (Σy_b² + eps)`` (each sequence normalised alone)."""
    _check(x, y, eps)
    dims = tuple(range(1, x.dim()))
    return _finite(((x - y).pow(2).sum(dims) / (y.pow(2).sum(dims) + eps)).mean(), x, y)


LOSSES: dict[str, Callable[[Tensor, Tensor, float], Tensor]] = {
    "normalized_mse": normalized_mse,
    "vectorwise": vectorwise_normalized_mse,
    "per_sample": per_sample_normalized_mse,
}


def get_loss(name: str) -> Callable[[Tensor, Tensor, float], Tensor]:
    """Look a block loss up by name (``normalized_mse``, ``vectorwise``, ``per_sample``)."""
    if name not in LOSSES:
        raise ValueError(f"loss={name!r} is unknown; choose one of {sorted(LOSSES)}")
    return LOSSES[name]
