"""Naive reference implementation of the generalized JSD: materialises every [..., V] tensor, plain autograd.

Used by the test-suite and the benchmark as the ground truth the chunked/fused forms must match; never
use them for training (peak memory O(B·T·V))."""

from __future__ import annotations

import math

import torch
from composer_core.loss.config import SDPOOptions
from torch import Tensor

__all__ = ["naive_jsd"]


def naive_jsd(
    student: Tensor, teacher: Tensor, beta: float, temperature: float = SDPOOptions.temperature
) -> Tensor:
    """Per-token generalized JSD [...] with the TRL GKD formula (``logsumexp`` of the stacked mixture terms)."""
    ls = torch.log_softmax(student / temperature, -1)
    lt = torch.log_softmax(teacher.detach() / temperature, -1)
    if beta == 0:
        return (lt.exp() * (lt - ls)).sum(-1)
    if beta == 1:
        return (ls.exp() * (ls - lt)).sum(-1)
    lm = torch.logsumexp(torch.stack([ls + math.log(1 - beta), lt + math.log(beta)]), 0)
    return beta * (lt.exp() * (lt - lm)).sum(-1) + (1 - beta) * (ls.exp() * (ls - lm)).sum(-1)
