"""composer_core's top-k distillation equals TRL's SDPO top-k loss (``trl.experimental.sdpo.loss_utils``).

TRL's ``distillation_add_tail`` defaults to False (renormalise over the student's top-k); composer's
``sdpo_topk_tail`` (``topk_distill(add_tail_bucket=...)``) defaults to True. Both settings are compared, per
token and in gradient, in float64, and through ``compose_loss`` (the masked token mean TRL's trainer takes).
"""

from __future__ import annotations

import pytest
import torch
from composer_core import ComposerBatch, compose_loss
from composer_core.loss.distill import topk_distill


@pytest.fixture(scope="module")
def trl_topk():
    from trl.experimental.sdpo.loss_utils import compute_topk_self_distillation_loss

    return compute_topk_self_distillation_loss


def _inputs(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    student = 3 * torch.randn(3, 5, 40, generator=g, dtype=torch.float64)
    teacher = 3 * torch.randn(3, 5, 40, generator=g, dtype=torch.float64)
    return student, teacher


@pytest.mark.parametrize("tail", [False, True])
@pytest.mark.parametrize("beta", [0.0, 0.3, 0.5, 1.0])
@pytest.mark.parametrize("k", [1, 4, 17])
def test_topk_distill_matches_trl_sdpo_topk(tail: bool, beta: float, k: int, trl_topk) -> None:
    student, teacher = _inputs(k * 10 + int(beta * 10))
    ours_in = student.clone().requires_grad_()
    theirs_in = student.clone().requires_grad_()
    ours = topk_distill(ours_in, teacher, k=k, beta=beta, add_tail_bucket=tail, reduction="none")
    theirs = trl_topk(
        theirs_in, teacher, distillation_topk=k, distillation_alpha=beta, distillation_add_tail=tail
    )
    torch.testing.assert_close(ours, theirs, rtol=1e-10, atol=1e-12)
    weights = torch.rand(ours.shape, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
    (ours * weights).sum().backward()
    (theirs * weights).sum().backward()
    torch.testing.assert_close(ours_in.grad, theirs_in.grad, rtol=1e-9, atol=1e-12)


def test_tail_changes_the_loss(trl_topk) -> None:
    """The option is not a no-op: with and without the tail bucket the values differ."""
    student, teacher = _inputs(1)
    with_tail = topk_distill(student, teacher, k=4, add_tail_bucket=True)
    without = topk_distill(student, teacher, k=4, add_tail_bucket=False)
    assert abs(with_tail.item() - without.item()) > 1e-3


def test_compose_loss_sdpo_topk_tail_false_matches_trl_masked_mean(trl_topk) -> None:
    student, teacher = _inputs(2)
    mask = torch.ones(3, 5, dtype=torch.bool)
    mask[1, 2:] = False
    batch = ComposerBatch(
        logprobs=torch.randn(3, 5, dtype=torch.float64) - 2,
        advantages=torch.zeros(3, dtype=torch.float64),
        completion_mask=mask,
        student_logits=student,
        teacher_logits=teacher,
    )
    out = compose_loss(
        batch, alpha_sdpo=1.0, sdpo_form="topk", sdpo_topk=6, sdpo_topk_tail=False, sdpo_beta=0.5
    )
    per_token = trl_topk(
        student, teacher, distillation_topk=6, distillation_alpha=0.5, distillation_add_tail=False
    )
    assert out.sdpo is not None
    torch.testing.assert_close(out.sdpo, per_token[mask].mean(), rtol=1e-12, atol=0.0)
    default = compose_loss(batch, alpha_sdpo=1.0, sdpo_form="topk", sdpo_topk=6, sdpo_beta=0.5)
    tailed = trl_topk(
        student, teacher, distillation_topk=6, distillation_alpha=0.5, distillation_add_tail=True
    )
    torch.testing.assert_close(default.sdpo, tailed[mask].mean(), rtol=1e-12, atol=0.0)
