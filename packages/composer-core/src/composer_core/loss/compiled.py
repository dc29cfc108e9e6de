"""The generalized-JSD chunk kernel under ``torch.compile`` (``compiled=True``; flat option ``sdpo_compiled``).

Same formulas as :func:`composer_core.loss.distill.jsd_kernel`, written as one functional graph per β branch so
that inductor fuses the elementwise passes over the [c, V] chunk (as Liger-Kernel's chunked losses do).

Shapes: ``zs``, ``zt`` [c, V] scaled student / teacher logits in the compute dtype. Returns (per-row loss [c],
gradient w.r.t. ``zs`` [c, V]) as new tensors. One graph per branch serves every β in (0, 1) (β enters as 0-dim
device tensors) and every chunk height (rows are marked dynamic).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from composer_core.loss.engine import Kernel

__all__ = ["compiled_jsd_kernel"]


def _fkl(zs: Tensor, zt: Tensor) -> tuple[Tensor, Tensor]:
    """β = 0: KL(p‖q) = Σ p (log p − log q); gradient q − p."""
    lq, lp = torch.log_softmax(zs, dim=-1), torch.log_softmax(zt, dim=-1)
    p = lp.exp()
    return (p * (lp - lq)).sum(-1), lq.exp() - p


def _rkl(zs: Tensor, zt: Tensor) -> tuple[Tensor, Tensor]:
    """β = 1: KL(q‖p) = Σ q·g with g = log q − log p; gradient q ⊙ (g − ⟨q, g⟩)."""
    lq = torch.log_softmax(zs, dim=-1)
    g = lq - torch.log_softmax(zt, dim=-1)
    q = lq.exp()
    loss = (q * g).sum(-1)
    return loss, q * (g - loss.unsqueeze(-1))


def _jsd(
    zs: Tensor, zt: Tensor, beta: Tensor, log_beta: Tensor, log_1m_beta: Tensor
) -> tuple[Tensor, Tensor]:
    """0 < β < 1: d = log q − log p, f = log m − log p = logaddexp(d + log(1−β), log β) (0 where d == 0),
    loss = (1−β)·Σ q·(d − f) − β·Σ p·f, gradient (1−β)·q ⊙ (g − ⟨q, g⟩) with g = d − f."""
    lq, lp = torch.log_softmax(zs, dim=-1), torch.log_softmax(zt, dim=-1)
    d = lq - lp
    f = torch.where(d == 0, 0.0, torch.logaddexp(d + log_1m_beta, log_beta))
    g = d - f
    q = lq.exp()
    kl_q = (q * g).sum(-1)
    kl_p = (lp.exp() * f).sum(-1).neg()
    loss = kl_q * (1.0 - beta) + kl_p * beta
    return loss, q * (g - kl_q.unsqueeze(-1)) * (1.0 - beta)


@functools.cache
def _compiled(fn: Callable[..., tuple[Tensor, Tensor]]) -> Callable[..., tuple[Tensor, Tensor]]:
    graph = torch.compile(fn, fullgraph=True)

    def run(zs: Tensor, zt: Tensor, *scalars: Tensor) -> tuple[Tensor, Tensor]:
        for z in (zs, zt):  # the chunk height varies (the last chunk, the batch): no recompilation for it
            torch._dynamo.maybe_mark_dynamic(z, 0)
        try:
            return graph(zs, zt, *scalars)
        except torch._dynamo.exc.BackendCompilerFailed as e:
            first = (str(e).strip() or type(e).__name__).splitlines()[0]
            raise RuntimeError(
                f"`compiled=True` (sdpo_compiled): torch.compile could not build the JSD chunk kernel on "
                f"{zs.device.type} ({first[:200]}); install what inductor needs there (a C++ compiler on a CPU, "
                "triton on a GPU) or pass compiled=False (sdpo_compiled=false)."
            ) from e

    return run


def compiled_jsd_kernel(beta: float) -> Kernel:
    """:func:`composer_core.loss.distill.jsd_kernel` under ``torch.compile`` (compiled on first use, once per
    branch, compute dtype and device)."""
    if beta == 0.0 or beta == 1.0:
        return _compiled(_fkl if beta == 0.0 else _rkl)
    interior = _compiled(_jsd)
    constants = (beta, math.log(beta), math.log(1.0 - beta))
    filled: dict[tuple[Any, ...], tuple[Tensor, ...]] = {}

    def kernel(zs: Tensor, zt: Tensor) -> tuple[Tensor, Tensor]:
        key = (zs.device, zs.dtype)
        if key not in filled:  # device fills (no host-to-device copy), once per loss call
            filled[key] = tuple(torch.full((), c, dtype=zs.dtype, device=zs.device) for c in constants)
        return interior(zs, zt, *filled[key])

    return kernel
