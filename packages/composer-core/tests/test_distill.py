from __future__ import annotations

import math

import pytest
import torch
from composer_core import fused_linear_generalized_jsd, generalized_jsd, sampled_token_distill, topk_distill
from composer_core.testing.reference import naive_jsd

D = torch.float64


def _logits(*shape: int, seed: int = 0, scale: float = 1.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g, dtype=D) * scale


# ------------------------------------------------------------------ closed form
@pytest.mark.parametrize(("beta", "expected"), [(0.0, 0.51083), (1.0, 0.36806), (0.5, 0.10175)])
def test_check_values_two_token_distribution(beta: float, expected: float) -> None:
    student = torch.tensor([[0.9, 0.1]], dtype=D).log()
    teacher = torch.tensor([[0.5, 0.5]], dtype=D).log()
    # closed forms: FKL = 0.5 ln(0.5/0.9) + 0.5 ln(0.5/0.1); RKL = 0.9 ln(0.9/0.5) + 0.1 ln(0.1/0.5)
    fkl = 0.5 * math.log(0.5 / 0.9) + 0.5 * math.log(0.5 / 0.1)
    rkl = 0.9 * math.log(0.9 / 0.5) + 0.1 * math.log(0.1 / 0.5)
    m = [0.7, 0.3]
    jsd = 0.5 * sum(p * math.log(p / mm) for p, mm in zip([0.5, 0.5], m)) + 0.5 * sum(
        q * math.log(q / mm) for q, mm in zip([0.9, 0.1], m)
    )
    exact = {0.0: fkl, 1.0: rkl, 0.5: jsd}[beta]
    value = generalized_jsd(student, teacher, beta=beta)
    assert value.item() == pytest.approx(exact, abs=1e-12)
    assert value.item() == pytest.approx(expected, abs=5e-6)


@pytest.mark.parametrize("beta", [0.0, 0.25, 0.5, 1.0])
def test_identical_distributions_give_zero_value_and_gradient(beta: float) -> None:
    z = _logits(3, 4, 17).requires_grad_(True)
    value = generalized_jsd(z, z.detach().clone(), beta=beta)
    (grad,) = torch.autograd.grad(value, z)
    assert value.item() == pytest.approx(0.0, abs=1e-14)
    assert grad.abs().max().item() < 1e-14


def test_beta_ends_are_exact_kl_not_mixture_limits() -> None:
    """β=0/1 are exact FKL/RKL branches: the interior formula → 0 at the ends, the loss must not."""
    s, t = _logits(5, 11, seed=1), _logits(5, 11, seed=2)
    fkl = generalized_jsd(s, t, beta=0.0)
    near0 = generalized_jsd(s, t, beta=1e-6)
    assert fkl.item() > 100 * near0.item()
    lt, ls = torch.log_softmax(t, -1), torch.log_softmax(s, -1)
    assert fkl.item() == pytest.approx((lt.exp() * (lt - ls)).sum(-1).mean().item(), rel=1e-12)
    rkl = generalized_jsd(s, t, beta=1.0)
    assert rkl.item() == pytest.approx((ls.exp() * (ls - lt)).sum(-1).mean().item(), rel=1e-12)


def test_temperature_scales_both_logits() -> None:
    s, t = _logits(4, 9, seed=3), _logits(4, 9, seed=4)
    assert generalized_jsd(s, t, temperature=2.0).item() == pytest.approx(
        generalized_jsd(s / 2, t / 2).item(), rel=1e-12
    )
    assert generalized_jsd(s, t, temperature=2.0).item() != pytest.approx(
        generalized_jsd(s, t).item(), rel=1e-3
    )


# ------------------------------------------------------------------ chunked == unchunked
@pytest.mark.parametrize("beta", [0.0, 0.3, 0.5, 1.0])
@pytest.mark.parametrize("chunk_size", [1, 3, 7, 1000])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_chunked_equals_naive_value_and_grad(beta: float, chunk_size: int, reduction: str) -> None:
    s = _logits(3, 5, 23, seed=5, scale=3.0).requires_grad_(True)
    t = _logits(3, 5, 23, seed=6, scale=3.0)
    mask = torch.rand(3, 5, generator=torch.Generator().manual_seed(7)) > 0.3
    out = generalized_jsd(
        s, t, beta=beta, mask=mask, chunk_size=chunk_size, temperature=0.7, reduction=reduction
    )  # type: ignore[arg-type]
    ref_tok = torch.where(mask, naive_jsd(s, t, beta, 0.7), torch.zeros(()))
    ref = {"mean": ref_tok.sum() / mask.sum(), "sum": ref_tok.sum(), "none": ref_tok}[reduction]
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-13)
    w = torch.randn(out.shape, dtype=D, generator=torch.Generator().manual_seed(8))
    (g,) = torch.autograd.grad((out * w).sum(), s)
    (g_ref,) = torch.autograd.grad((ref * w).sum(), s)
    torch.testing.assert_close(g, g_ref, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_gradcheck_generalized_jsd(beta: float) -> None:
    s = _logits(2, 3, 6, seed=9).requires_grad_(True)
    t = _logits(2, 3, 6, seed=10)
    mask = torch.tensor([[1, 0, 1], [1, 1, 0]], dtype=torch.bool)
    assert torch.autograd.gradcheck(lambda x: generalized_jsd(x, t, beta=beta, mask=mask, chunk_size=2), (s,))
    assert torch.autograd.gradcheck(
        lambda x: generalized_jsd(x, t, beta=beta, mask=mask, chunk_size=2, reduction="none"), (s,)
    )


# ------------------------------------------------------------------ fused linear
@pytest.mark.parametrize("chunk_size", [1, 4, 64])
@pytest.mark.parametrize("beta", [0.0, 0.4, 1.0])
def test_fused_linear_equals_logits_form(chunk_size: int, beta: float) -> None:
    h = _logits(3, 4, 6, seed=11).requires_grad_(True)
    ht = _logits(3, 4, 6, seed=12)
    w = _logits(13, 6, seed=13).requires_grad_(True)
    b = _logits(13, seed=14).requires_grad_(True)
    mask = torch.rand(3, 4, generator=torch.Generator().manual_seed(15)) > 0.4
    out = fused_linear_generalized_jsd(h, w, ht, lm_head_bias=b, beta=beta, mask=mask, chunk_size=chunk_size)
    logits_t = (ht @ w.T + b).detach()
    ref = naive_jsd(h @ w.T + b, logits_t, beta)[mask].mean()
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-13)
    grads = torch.autograd.grad(out * 1.7, (h, w, b))
    grads_ref = torch.autograd.grad(ref * 1.7, (h, w, b))
    for a, c in zip(grads, grads_ref):
        torch.testing.assert_close(a, c, rtol=1e-10, atol=1e-12)


def test_gradcheck_fused_linear() -> None:
    h = _logits(2, 3, 5, seed=16).requires_grad_(True)
    ht = _logits(2, 3, 5, seed=17)
    w = _logits(7, 5, seed=18).requires_grad_(True)
    b = _logits(7, seed=19).requires_grad_(True)
    tw, tb = w.detach().clone(), b.detach().clone()  # teacher head held fixed (it is detached by design)
    assert torch.autograd.gradcheck(
        lambda h_, w_, b_: fused_linear_generalized_jsd(
            h_, w_, ht, lm_head_bias=b_, teacher_lm_head_weight=tw, teacher_lm_head_bias=tb, chunk_size=4
        ),
        (h, w, b),
    )


# ------------------------------------------------------------------ top-k
def test_topk_full_support_with_tail_equals_full_jsd() -> None:
    s, t = _logits(4, 8, seed=20), _logits(4, 8, seed=21)
    for beta in (0.0, 0.5, 1.0):
        torch.testing.assert_close(
            topk_distill(s, t, k=8, beta=beta), generalized_jsd(s, t, beta=beta), rtol=1e-6, atol=1e-9
        )


def test_topk_closed_form_tail_bucket() -> None:
    # student probs [0.6, 0.3, 0.1], teacher [0.2, 0.5, 0.3]; k=1 on student support -> {0}, tail = rest
    s = torch.tensor([[0.6, 0.3, 0.1]], dtype=D).log()
    t = torch.tensor([[0.2, 0.5, 0.3]], dtype=D).log()
    fkl = 0.2 * math.log(0.2 / 0.6) + 0.8 * math.log(0.8 / 0.4)
    assert topk_distill(s, t, k=1, beta=0.0).item() == pytest.approx(fkl, abs=1e-9)
    # teacher support -> {1}: p=[0.5, 0.5], q=[0.3, 0.7]
    fkl_t = 0.5 * math.log(0.5 / 0.3) + 0.5 * math.log(0.5 / 0.7)
    assert topk_distill(s, t, k=1, beta=0.0, support="teacher").item() == pytest.approx(fkl_t, abs=1e-9)
    # no tail bucket, k=2 student support {0,1}: renormalised p=[2/7,5/7], q=[2/3,1/3]
    p, q = [2 / 7, 5 / 7], [2 / 3, 1 / 3]
    rkl = sum(qq * math.log(qq / pp) for pp, qq in zip(p, q))
    assert topk_distill(s, t, k=2, beta=1.0, add_tail_bucket=False).item() == pytest.approx(rkl, abs=1e-9)


def test_gradcheck_topk() -> None:
    s = _logits(3, 7, seed=22).requires_grad_(True)
    t = _logits(3, 7, seed=23)
    for tail in (True, False):
        assert torch.autograd.gradcheck(
            lambda x, tail=tail: topk_distill(x, t, k=3, add_tail_bucket=tail), (s,)
        )


# ------------------------------------------------------------------ sampled token
def test_sampled_token_check_values() -> None:
    ls = torch.tensor([[math.log(0.5)]], dtype=D, requires_grad=True)
    lt = torch.tensor([[math.log(0.25)]], dtype=D)
    v = sampled_token_distill(ls, lt, torch.ones(1, 1, dtype=torch.bool))
    (g,) = torch.autograd.grad(v, ls)
    assert v.item() == pytest.approx(math.log(2), abs=1e-12)
    assert g.item() == pytest.approx(0.69315, abs=1e-5)


def test_sampled_token_is_clip() -> None:
    ls = torch.tensor([[0.0, -1.0]], dtype=D, requires_grad=True)
    lt = torch.tensor([[-1.0, -1.5]], dtype=D)
    old = torch.tensor([[-2.0, -1.0]], dtype=D)  # ratios e^2 -> clipped to 2, and 1
    v = sampled_token_distill(ls, lt, torch.ones(1, 2), old_logprobs=old, is_clip=2.0, reduction="sum")
    (g,) = torch.autograd.grad(v, ls)
    torch.testing.assert_close(g, torch.tensor([[2.0 * 1.0, 1.0 * 0.5]], dtype=D))
    v_none = sampled_token_distill(ls, lt, torch.ones(1, 2), old_logprobs=old, is_clip=None, reduction="sum")
    assert v_none.item() == pytest.approx(1.0 + 0.5, abs=1e-12)
