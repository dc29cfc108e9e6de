"""composer's fused JSD equals Liger-Kernel's ``LigerFusedLinearJSDLoss`` with a teacher of another hidden size.

Liger takes student_input [N, Hs], student_weight [V, Hs], teacher_input [N, Ht], teacher_weight [V, Ht]; so does
:func:`composer_core.fused_linear_generalized_jsd` (issue 50). liger-kernel comes with the ``bench`` extra
(``nox -s tests-core-extras``); elsewhere the test is skipped.
"""

from __future__ import annotations

import pytest
import torch
from composer_core import fused_linear_generalized_jsd

liger = pytest.importorskip(
    "liger_kernel.chunked_loss",
    reason="liger-kernel is not installed (the `bench` extra: nox -s tests-core-extras)",
)

D = torch.float64
N, V, HS, HT = 12, 19, 16, 24


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_equals_liger_with_a_teacher_of_another_hidden_size(beta: float) -> None:
    g = torch.Generator().manual_seed(50)
    h = torch.randn(N, HS, generator=g, dtype=D).requires_grad_(True)
    w = (torch.randn(V, HS, generator=g, dtype=D) / 2).requires_grad_(True)
    ht = torch.randn(N, HT, generator=g, dtype=D)
    wt = torch.randn(V, HT, generator=g, dtype=D) / 2
    labels = torch.randint(0, V, (N,), generator=g)
    labels[torch.rand(N, generator=g) > 0.7] = -100  # Liger's ignore_index = composer's mask
    mask = labels != -100

    ours = fused_linear_generalized_jsd(
        h, w, ht, teacher_lm_head_weight=wt, beta=beta, temperature=1.5, mask=mask, chunk_size=5
    )
    theirs = liger.LigerFusedLinearJSDLoss(
        weight_hard_loss=0.0, weight_soft_loss=1.0, beta=beta, temperature=1.5, compiled=False, chunk_size=5
    )(h, w, ht, wt, labels)
    # Liger accumulates its loss in float32 (its gradients stay float64): the value agrees to float32 rounding
    assert theirs.dtype == torch.float32
    torch.testing.assert_close(ours.float(), theirs, rtol=1e-6, atol=0)
    for a, b in zip(torch.autograd.grad(ours, (h, w)), torch.autograd.grad(theirs, (h, w))):
        assert b.dtype == D
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-14)
