"""composer_core's generalized JSD equals TRL's GKD loss (trl.experimental.gkd) on random inputs."""

from __future__ import annotations

import pytest
import torch
from composer_core.loss.distill import fused_linear_generalized_jsd, generalized_jsd


@pytest.fixture(scope="module")
def gkd_loss():
    from trl.experimental.gkd import GKDTrainer

    return GKDTrainer.generalized_jsd_loss


@pytest.mark.parametrize("beta", [0.0, 0.1, 0.5, 0.9, 1.0])
@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_generalized_jsd_matches_trl_gkd(beta, temperature, gkd_loss):
    g = torch.Generator().manual_seed(int(beta * 100) + int(temperature * 10))
    student = (3 * torch.randn(3, 7, 33, generator=g, dtype=torch.float64)).requires_grad_()
    teacher = 3 * torch.randn(3, 7, 33, generator=g, dtype=torch.float64)
    labels = torch.randint(0, 33, (3, 7), generator=g)
    labels[0, :3] = -100
    labels[2, 5:] = -100
    mask = labels != -100

    ours = generalized_jsd(student, teacher, beta=beta, temperature=temperature, mask=mask)
    student_ref = student.detach().clone().requires_grad_()
    theirs = gkd_loss(
        student_ref, teacher, labels=labels, beta=beta, temperature=temperature, reduction="batchmean"
    )
    torch.testing.assert_close(ours, theirs, rtol=1e-10, atol=1e-12)
    ours.backward()
    theirs.backward()
    torch.testing.assert_close(student.grad, student_ref.grad, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_fused_hidden_state_form_matches_trl_gkd_on_logits(beta, gkd_loss):
    """The adapter's form (hidden states + LM-head weight, chunked) equals GKD on the materialised logits."""
    g = torch.Generator().manual_seed(7)
    h_s = torch.randn(2, 5, 16, generator=g, dtype=torch.float64, requires_grad=True)
    h_t = torch.randn(2, 5, 16, generator=g, dtype=torch.float64)
    w = torch.randn(40, 16, generator=g, dtype=torch.float64, requires_grad=True)
    labels = torch.randint(0, 40, (2, 5), generator=g)
    labels[1, 3:] = -100
    ours = fused_linear_generalized_jsd(h_s, w, h_t, beta=beta, mask=labels != -100, chunk_size=3)
    h_s2, w2 = h_s.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    theirs = gkd_loss(h_s2 @ w2.T, (h_t @ w2.T).detach(), labels=labels, beta=beta)
    torch.testing.assert_close(ours, theirs, rtol=1e-10, atol=1e-12)
    ours.backward()
    theirs.backward()
    torch.testing.assert_close(h_s.grad, h_s2.grad, rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(w.grad, w2.grad, rtol=1e-9, atol=1e-12)
