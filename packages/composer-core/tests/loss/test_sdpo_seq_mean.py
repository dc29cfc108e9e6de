"""sdpo_loss_agg='seq_mean' (TRL SDPOTrainer's aggregation) and a teacher LM head of its own (EMA teacher)."""

from __future__ import annotations

import pytest
import torch
from composer_core import ComposerBatch
from composer_core import compose_loss as core_compose_loss


def compose_loss(batch: ComposerBatch, config: object = None, /, **options: object):  # type: ignore[no-untyped-def]
    """core's ``compose_loss`` with channels 2 and 3 on (weight 1) unless the test sets their weights (core's
    defaults are 0)."""
    if config is None:
        options = {"alpha_sdpo": 1.0, "beta_replay": 1.0, **options}
    return core_compose_loss(batch, config, **options)  # type: ignore[arg-type]


B, T, V, H = 4, 5, 11, 6
D = torch.float64
MASK = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [0, 0, 0, 0, 0], [1, 0, 0, 0, 0]]).bool()


def _kl(lt: torch.Tensor, ls: torch.Tensor) -> torch.Tensor:  # KL(teacher || student), per token
    return (lt.exp() * (lt - ls)).sum(-1)


def _seq_mean(per_token: torch.Tensor, rows: float) -> torch.Tensor:
    return ((per_token * MASK).sum(-1) / MASK.sum(-1).clamp(min=1)).sum() / rows


def _batch(g: torch.Generator, **kw: torch.Tensor) -> ComposerBatch:
    return ComposerBatch(
        logprobs=torch.randn(B, T, generator=g, dtype=D) - 2,
        advantages=torch.zeros(B, dtype=D),
        completion_mask=torch.ones(B, T),
        sdpo_mask=MASK,
        **kw,
    )


@pytest.mark.parametrize("normalizer", [None, 10.0])
def test_seq_mean_logits_equals_the_closed_form_over_all_rows(normalizer: float | None) -> None:
    g = torch.Generator().manual_seed(0)
    zs = torch.randn(B, T, V, generator=g, dtype=D, requires_grad=True)
    zt = torch.randn(B, T, V, generator=g, dtype=D)
    b = _batch(g, student_logits=zs, teacher_logits=zt)
    out = compose_loss(b, sdpo_form="full", sdpo_beta=0.0, sdpo_loss_agg="seq_mean",
                       sdpo_normalizer=normalizer)  # fmt: skip
    ref = _seq_mean(_kl(torch.log_softmax(zt, -1), torch.log_softmax(zs, -1)), normalizer or B)
    torch.testing.assert_close(out.sdpo, ref, rtol=1e-12, atol=1e-14)
    token_mean = compose_loss(b, sdpo_form="full", sdpo_beta=0.0).sdpo
    assert not torch.allclose(token_mean, ref)  # the two aggregations differ on this mask


def test_seq_mean_sampled_and_topk_equal_their_closed_forms() -> None:
    g = torch.Generator().manual_seed(1)
    zs = torch.randn(B, T, V, generator=g, dtype=D, requires_grad=True)
    zt = torch.randn(B, T, V, generator=g, dtype=D)
    b = _batch(g, student_logits=zs, teacher_logits=zt)
    out = compose_loss(b, sdpo_form="topk", sdpo_topk=V, sdpo_topk_tail=False, sdpo_beta=0.0,
                       sdpo_loss_agg="seq_mean")  # fmt: skip
    ref = _seq_mean(
        _kl(torch.log_softmax(zt, -1), torch.log_softmax(zs, -1)), B
    )  # k = V: the full divergence
    torch.testing.assert_close(out.sdpo, ref, rtol=1e-10, atol=1e-12)
    ls = (torch.randn(B, T, generator=g, dtype=D) - 2).requires_grad_(True)
    lt = torch.randn(B, T, generator=g, dtype=D) - 2
    s = ComposerBatch(logprobs=ls, advantages=torch.zeros(B, dtype=D), completion_mask=torch.ones(B, T),
                      sdpo_mask=MASK, teacher_logprobs=lt)  # fmt: skip
    out = compose_loss(s, sdpo_form="sampled", sdpo_loss_agg="seq_mean")
    torch.testing.assert_close(out.sdpo, _seq_mean(ls.detach() - lt, B), rtol=1e-12, atol=1e-14)


def test_seq_mean_fused_with_a_teacher_head_of_its_own_gradchecks() -> None:
    """The fused form (hidden states + heads) equals the logits path with teacher logits = h_T W_Tᵀ + b_T, and its
    float64 gradient w.r.t. the student's hidden states and head passes gradcheck; the teacher head gets none."""
    g = torch.Generator().manual_seed(2)
    hs = torch.randn(B, T, H, generator=g, dtype=D, requires_grad=True)
    ht = torch.randn(B, T, H, generator=g, dtype=D)
    w = torch.randn(V, H, generator=g, dtype=D, requires_grad=True)
    wt = torch.randn(V, H, generator=g, dtype=D, requires_grad=True)
    bt = torch.randn(V, generator=g, dtype=D)

    def fused(hs_: torch.Tensor, w_: torch.Tensor) -> torch.Tensor:
        b = _batch(g, student_hidden=hs_, teacher_hidden=ht, lm_head_weight=w_, teacher_lm_head_weight=wt,
                   teacher_lm_head_bias=bt)  # fmt: skip
        out = compose_loss(b, sdpo_form="full", sdpo_beta=0.3, sdpo_loss_agg="seq_mean")
        assert out.sdpo is not None
        return out.sdpo

    logits = _batch(g, student_logits=hs @ w.T, teacher_logits=(ht @ wt.T + bt).detach())
    ref = compose_loss(logits, sdpo_form="full", sdpo_beta=0.3, sdpo_loss_agg="seq_mean").sdpo
    torch.testing.assert_close(fused(hs, w), ref, rtol=1e-10, atol=1e-12)
    assert torch.autograd.gradcheck(fused, (hs, w), eps=1e-6, atol=1e-6)
    fused(hs, w).backward()
    assert wt.grad is None
