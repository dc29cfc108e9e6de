from __future__ import annotations

import torch
from composer_core import ComposerBatch, compose_loss, policy_loss

D = torch.float64


def _batch(seed: int = 0) -> ComposerBatch:
    g = torch.Generator().manual_seed(seed)
    B, T, V, P = 4, 5, 9, 3
    return ComposerBatch(
        logprobs=(torch.randn(B, T, generator=g, dtype=D) - 2).requires_grad_(True),
        advantages=torch.randn(B, generator=g, dtype=D),
        completion_mask=torch.ones(B, T),
        student_logits=torch.randn(B, T, V, generator=g, dtype=D).requires_grad_(True),
        teacher_logits=torch.randn(B, T, V, generator=g, dtype=D),
        chosen_logps=torch.randn(P, generator=g, dtype=D).requires_grad_(True),
        rejected_logps=torch.randn(P, generator=g, dtype=D).requires_grad_(True),
        ref_chosen_logps=torch.randn(P, generator=g, dtype=D),
        ref_rejected_logps=torch.randn(P, generator=g, dtype=D),
    )


def test_zero_weights_reproduce_policy_only_loss_and_grads_bit_exactly() -> None:
    b = _batch()
    r = compose_loss(b, alpha_sdpo=0.0, beta_replay=0.0)
    p = policy_loss(b.logprobs, b.advantages, b.completion_mask)
    assert torch.equal(r.total, p.loss)
    (g1,) = torch.autograd.grad(r.total, b.logprobs)
    (g2,) = torch.autograd.grad(p.loss, b.logprobs)
    assert torch.equal(g1, g2)
    assert r.distill is None and r.preference is None
    assert r.metrics["skipped/sdpo"] == 1.0 and r.metrics["skipped/replay"] == 1.0


def test_total_is_weighted_sum() -> None:
    b = _batch()
    r = compose_loss(b, alpha_sdpo=0.3, beta_replay=2.0)
    assert r.distill is not None and r.preference is not None
    torch.testing.assert_close(r.total, r.policy + 0.3 * r.distill + 2.0 * r.preference)
    assert r.metrics["skipped/sdpo"] == 0.0 and r.metrics["sdpo/tokens"] == 20.0
    assert r.metrics["replay/pairs"] == 3.0
