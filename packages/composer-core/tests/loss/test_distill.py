from __future__ import annotations

import math

import pytest
import torch
from composer_core import fused_linear_generalized_jsd, generalized_jsd, sampled_token_distill, topk_distill
from composer_testkit.reference import naive_jsd

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


# ------------------------------------------------------------------ the default chunk: a budget of logits
#: The default chunk's logits: on logits, four float32 work buffers of BUDGET entries are 0.5 GB; fused, the
#: budget is a quarter of that with a floor of FUSED_ROWS rows.
BUDGET, FUSED_BUDGET, FUSED_ROWS = 1024 * 32_768, 256 * 32_768, 256


@pytest.mark.parametrize("form", ["logits", "fused"])
@pytest.mark.parametrize(("vocab", "tokens"), [(32_768, 1100), (152_064, 300), (8_192, 1100)])
def test_the_default_chunk_holds_a_budget_of_logits_per_form(
    form: str, vocab: int, tokens: int, chunk_widths: list[int]
) -> None:
    """Rows per chunk by default: BUDGET // V on logits (1024 at V = 32,768; 220 at Qwen2's 152,064; a fixed
    1024 held 2.3 GiB at 152,064 and ran 2.4x slower), max(FUSED_ROWS, FUSED_BUDGET // V) fused (256 at 32,768
    and at 152,064, 1024 at 8,192: at V = 32,768 a 1024-row fused default held 0.73x Liger's extra memory on an
    H200 against the 0.35 target of #19, 256 rows 0.31x). The loss equals an explicit chunk's exactly."""
    from composer_core.loss import distill

    widths = chunk_widths
    g = torch.Generator().manual_seed(0)
    if form == "logits":
        s, t = torch.randn(tokens, vocab, generator=g), torch.randn(tokens, vocab, generator=g)
        run = lambda **kw: generalized_jsd(s, t, **kw)  # noqa: E731
        rows = BUDGET // vocab
    else:
        h, ht = torch.randn(tokens, 4, generator=g), torch.randn(tokens, 4, generator=g)
        w = torch.randn(vocab, 4, generator=g)
        run = lambda **kw: fused_linear_generalized_jsd(h, w, ht, **kw)  # noqa: E731
        rows = max(FUSED_ROWS, FUSED_BUDGET // vocab)
    default = run()
    assert max(widths) == min(rows, tokens), (max(widths), rows)
    assert len(widths) == 2 * math.ceil(tokens / rows)  # student and teacher rows of every chunk
    widths.clear()
    torch.testing.assert_close(default, run(chunk_size=rows), rtol=0, atol=0)
    assert (
        distill.chunk_rows(None, 1, fused=False) == BUDGET
        and distill.chunk_rows(None, 10 * BUDGET, fused=False) == 1
    )
    assert distill.chunk_rows(None, 10 * BUDGET, fused=True) == FUSED_ROWS
    assert distill.chunk_rows(7, vocab, fused=form == "fused") == 7


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


@pytest.mark.parametrize("form", ["logits", "fused"])
def test_the_gradient_follows_grad_out_through_the_unit_fast_path(form: str) -> None:
    """Backward skips the multiply when the incoming gradient is exactly 1 (a host read on the CPU): 1 gives the
    reference gradient, and 2 and 0.5 (exact in binary) give it times 2 and 0.5, bit for bit."""
    h, ht = _logits(3, 4, 6, seed=21).requires_grad_(True), _logits(3, 4, 6, seed=22)
    w = _logits(13, 6, seed=23)
    mask = torch.rand(3, 4, generator=torch.Generator().manual_seed(24)) > 0.4
    if form == "fused":
        out = fused_linear_generalized_jsd(h, w, ht, beta=0.3, mask=mask, chunk_size=4)
    else:
        out = generalized_jsd(h @ w.T, ht @ w.T, beta=0.3, mask=mask, chunk_size=4)
    (want,) = torch.autograd.grad(naive_jsd(h @ w.T, ht @ w.T, 0.3)[mask].mean(), h)
    one, two, half = (
        torch.autograd.grad(out, h, grad_outputs=torch.tensor(c, dtype=D), retain_graph=True)[0]
        for c in (1, 2, 0.5)
    )
    torch.testing.assert_close(one, want, rtol=1e-10, atol=1e-12)
    assert torch.equal(two, 2 * one) and torch.equal(half, 0.5 * one)


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


# ------------------------------------------------------------------ kwargs and bookkeeping
def test_normalizer_divides_the_masked_sum() -> None:
    s, t = _logits(2, 3, 5, seed=30), _logits(2, 3, 5, seed=31)
    total = generalized_jsd(s, t, reduction="sum")
    assert generalized_jsd(s, t, normalizer=10.0).item() == pytest.approx(total.item() / 10.0, rel=1e-12)
    assert generalized_jsd(s, t, normalizer=torch.tensor(4)).item() == pytest.approx(
        total.item() / 4, rel=1e-12
    )
    assert generalized_jsd(s, t).item() == pytest.approx(total.item() / 6, rel=1e-12)


def test_masked_tokens_get_zero_gradient_and_teacher_gets_none() -> None:
    s = _logits(2, 3, 5, seed=32).requires_grad_(True)
    t = _logits(2, 3, 5, seed=33).requires_grad_(True)
    mask = torch.tensor([[True, False, True], [False, False, True]])
    generalized_jsd(s, t, mask=mask, chunk_size=2).backward()
    assert s.grad is not None and t.grad is None
    assert torch.equal(s.grad[~mask], torch.zeros_like(s.grad[~mask]))
    assert bool((s.grad[mask].abs().sum(-1) > 0).all())


def test_low_precision_inputs_are_computed_in_float32() -> None:
    s32, t32 = _logits(4, 50, seed=34).float(), _logits(4, 50, seed=35).float()
    s16 = s32.bfloat16().requires_grad_(True)
    out = generalized_jsd(s16, t32.bfloat16())
    assert out.dtype == torch.float32
    ref = generalized_jsd(s16.detach().float(), t32.bfloat16().float())
    assert out.item() == pytest.approx(ref.item(), rel=1e-6)
    out.backward()
    assert s16.grad is not None and s16.grad.dtype == torch.bfloat16


def test_fused_separate_teacher_head_and_sum_reduction() -> None:
    h, ht = _logits(5, 4, seed=36).requires_grad_(True), _logits(5, 4, seed=37)
    w, wt = _logits(9, 4, seed=38).requires_grad_(True), _logits(9, 4, seed=39)
    out = fused_linear_generalized_jsd(
        h, w, ht, teacher_lm_head_weight=wt, reduction="sum", chunk_size=2, beta=0.0
    )
    ref = naive_jsd(h @ w.T, ht @ wt.T, 0.0).sum()
    torch.testing.assert_close(out, ref)
    g = torch.autograd.grad(out, (h, w))
    g_ref = torch.autograd.grad(ref, (h, w))
    for a, c in zip(g, g_ref):
        torch.testing.assert_close(a, c)
    # a frozen head (no grad) only yields the hidden-state gradient
    out2 = fused_linear_generalized_jsd(h, w.detach(), ht, temperature=2.0)
    ref2 = naive_jsd(h @ w.detach().T, ht @ w.detach().T, 0.5, 2.0).mean()
    torch.testing.assert_close(out2, ref2)
    torch.testing.assert_close(torch.autograd.grad(out2, h)[0], torch.autograd.grad(ref2, h)[0])


# ------------------------------------------------------------------ bad input
def _bad(fn: object, match: str) -> None:
    assert callable(fn)
    with pytest.raises(ValueError, match=match):
        fn()


def test_generalized_jsd_bad_inputs() -> None:
    s, t = _logits(2, 3, 5, seed=40), _logits(2, 3, 5, seed=41)
    nan = s.clone()
    nan[0, 1, 2] = float("nan")
    inf = t.clone()
    inf[1, 0, 0] = float("-inf")
    _bad(lambda: generalized_jsd(nan, t), "student_logits.*NaN")
    _bad(lambda: generalized_jsd(s, inf), "teacher_logits.*NaN/inf")
    _bad(lambda: generalized_jsd(s, t[..., :4]), "teacher_logits.*shape")
    _bad(lambda: generalized_jsd(s, t[:1]), "teacher_logits.*shape")
    _bad(lambda: generalized_jsd(s, t, mask=torch.zeros(2, 3, dtype=torch.bool)), "mask.*selects no token")
    _bad(lambda: generalized_jsd(s, t, mask=torch.ones(3, 2)), "mask.*shape")
    _bad(lambda: generalized_jsd(s, t, mask=torch.full((2, 3), 0.5)), "mask.*0/1")
    _bad(lambda: generalized_jsd(s, t, beta=1.5), "beta")
    _bad(lambda: generalized_jsd(s, t, temperature=0.0), "temperature")
    _bad(lambda: generalized_jsd(s, t, chunk_size=0), "chunk_size")
    _bad(lambda: generalized_jsd(s, t, reduction="batchmean"), "reduction")  # type: ignore[arg-type]
    _bad(lambda: generalized_jsd(s, t, reduction="sum", normalizer=3), "normalizer")
    _bad(lambda: generalized_jsd(s, t, normalizer=0), "normalizer")
    _bad(lambda: generalized_jsd(s[0, 0], t[0, 0]), "dimension")
    _bad(lambda: generalized_jsd(s.long(), t), "floating-point")


def test_fused_reads_the_lm_head_only_in_its_matmuls() -> None:
    """The head [V, H] is a model parameter read every step: its values are not scanned for NaN/inf on each call
    (at SmolLM2's 49,152 x 576 that scan cost 0.15 s on one thread, a quarter of the fused loss); a non-finite
    entry reaches every row's logits and the loss total's check names it (test above)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    h, w = _logits(3, 4, seed=46).requires_grad_(), _logits(7, 4, seed=47).requires_grad_()
    bias = torch.zeros(7, dtype=D, requires_grad=True)
    heads = {w.data_ptr(), bias.data_ptr()}
    reads: list[str] = []

    class Reads(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            flat = [*args, *(kwargs or {}).values()]
            if any(isinstance(a, torch.Tensor) and a.data_ptr() in heads for a in flat):
                reads.append(func.__name__)
            return func(*args, **(kwargs or {}))

    with Reads():
        fused_linear_generalized_jsd(h, w, h.detach() + 1, lm_head_bias=bias).backward()
    scans = [r for r in reads if r.split(".")[0] in {"isfinite", "abs", "eq", "ne", "isnan", "isinf", "all"}]
    assert not scans, reads
    assert any(r.startswith(("mm", "matmul", "addmm")) for r in reads), reads  # the check above can fail


def test_fused_and_topk_and_sampled_bad_inputs() -> None:
    h, w = _logits(2, 4, seed=42), _logits(7, 4, seed=43)
    _bad(lambda: fused_linear_generalized_jsd(h, w[:, :3], h), "lm_head_weight.*\\[V, H\\]")
    _bad(lambda: fused_linear_generalized_jsd(h, w, h[:, :3]), "teacher_hidden.*shape")
    _bad(lambda: fused_linear_generalized_jsd(h, w, h, lm_head_bias=torch.zeros(6, dtype=D)), "lm_head_bias")
    _bad(
        lambda: fused_linear_generalized_jsd(h, w, h, teacher_lm_head_weight=w[:5]), "teacher_lm_head_weight"
    )
    _bad(lambda: fused_linear_generalized_jsd(h, w * float("nan"), h), "lm_head_weight.*NaN")
    inf_bias = torch.zeros(7, dtype=D)
    inf_bias[3] = float("inf")
    _bad(lambda: fused_linear_generalized_jsd(h, w, h, lm_head_bias=inf_bias), "lm_head_bias.*NaN")
    _bad(
        lambda: fused_linear_generalized_jsd(h, w, h, teacher_lm_head_weight=w * float("nan")),
        "teacher_lm_head_weight.*NaN",
    )
    _bad(lambda: fused_linear_generalized_jsd(h, w, h, reduction="none"), "reduction")  # type: ignore[arg-type]
    s, t = _logits(2, 7, seed=44), _logits(2, 7, seed=45)
    _bad(lambda: topk_distill(s, t, k=0), "`k`")
    _bad(lambda: topk_distill(s, t, k=8), "`k`")
    _bad(lambda: topk_distill(s, t, k=2, support="both"), "support")  # type: ignore[arg-type]
    lp = torch.zeros(2, 3, dtype=D)
    _bad(lambda: sampled_token_distill(lp, lp[:, :2], torch.ones(2, 3)), "teacher_logprobs.*shape")
    _bad(lambda: sampled_token_distill(lp, lp, torch.zeros(2, 3)), "mask.*selects no token")
    _bad(lambda: sampled_token_distill(lp, lp, torch.ones(2, 3), is_clip=0.0), "is_clip")
    _bad(lambda: sampled_token_distill(lp, lp * float("nan"), torch.ones(2, 3)), "teacher_logprobs.*NaN")


# ------------------------------------------------------------------ sampled-token kwargs
def test_sampled_token_reductions_normalizer_and_no_old() -> None:
    ls = torch.tensor([[0.0, -1.0, -2.0]], dtype=D)
    lt = torch.tensor([[-1.0, -1.0, -1.0]], dtype=D)
    m = torch.tensor([[1, 1, 0]])
    torch.testing.assert_close(
        sampled_token_distill(ls, lt, m, reduction="none"), torch.tensor([[1.0, 0.0, 0.0]], dtype=D)
    )
    assert sampled_token_distill(ls, lt, m).item() == pytest.approx(0.5)
    assert sampled_token_distill(ls, lt, m, normalizer=4).item() == pytest.approx(0.25)
    # old_logprobs given but is_clip=None -> no IS weighting at all (TRL: distillation_is_clip=None)
    old = ls - 1.0
    assert sampled_token_distill(ls, lt, m, old_logprobs=old, is_clip=None).item() == pytest.approx(0.5)
    assert sampled_token_distill(ls, lt, m, old_logprobs=old, is_clip=10.0).item() == pytest.approx(
        0.5 * math.e
    )


def test_sampled_token_gradient_is_exact_reverse_kl_gradient_in_expectation() -> None:
    """Its gradient is by design sg(d)·∇ℓS, not the derivative of the logged value d. The float64 check:
    weighting every vocabulary token y by sg(q_y) (the exact on-policy expectation), the summed gradient
    must equal the central finite-difference gradient of KL(q‖p) itself."""
    g = torch.Generator().manual_seed(46)
    z = torch.randn(7, dtype=D, generator=g).requires_grad_(True)
    zt = torch.randn(7, dtype=D, generator=g)
    ls = torch.log_softmax(z, -1)[None]
    lt = torch.log_softmax(zt, -1)[None]
    per_token = sampled_token_distill(ls, lt, torch.ones(1, 7), reduction="none")
    (grad,) = torch.autograd.grad((per_token * ls.detach().exp()).sum(), z)

    def rkl(x: torch.Tensor) -> float:
        lq, lp = torch.log_softmax(x, -1), torch.log_softmax(zt, -1)
        return float((lq.exp() * (lq - lp)).sum())

    eps = 1e-6
    numeric = torch.tensor(
        [(rkl(z.detach() + eps * e) - rkl(z.detach() - eps * e)) / (2 * eps) for e in torch.eye(7, dtype=D)],
        dtype=D,
    )
    torch.testing.assert_close(grad, numeric, rtol=1e-6, atol=1e-9)


# ------------------------------------------------------------------ properties (hypothesis)
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402


@settings(max_examples=60, deadline=None)
@given(data=st.data(), beta=st.floats(0.0, 1.0))
def test_property_jsd_nonnegative_and_zero_on_identical(data: st.DataObject, beta: float) -> None:
    v = data.draw(st.integers(2, 12))
    row = st.lists(st.floats(-20, 20, allow_nan=False), min_size=v, max_size=v)
    s = torch.tensor([data.draw(row)], dtype=D)
    t = torch.tensor([data.draw(row)], dtype=D)
    assert generalized_jsd(s, t, beta=beta).item() >= -1e-12
    assert generalized_jsd(s, s.clone(), beta=beta).item() == pytest.approx(0.0, abs=1e-12)


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_property_jsd_half_bounded_by_ln2(data: st.DataObject) -> None:
    v = data.draw(st.integers(2, 12))
    row = st.lists(st.floats(-30, 30, allow_nan=False), min_size=v, max_size=v)
    s = torch.tensor([data.draw(row)], dtype=D)
    t = torch.tensor([data.draw(row)], dtype=D)
    assert generalized_jsd(s, t, beta=0.5).item() <= math.log(2) + 1e-12


@settings(max_examples=40, deadline=None)
@given(data=st.data(), beta=st.sampled_from([0.0, 0.5, 1.0]), chunk=st.integers(1, 9))
def test_property_chunk_size_does_not_change_value(data: st.DataObject, beta: float, chunk: int) -> None:
    n = data.draw(st.integers(1, 8))
    s = torch.tensor(
        data.draw(st.lists(st.lists(st.floats(-10, 10), min_size=5, max_size=5), min_size=n, max_size=n)),
        dtype=D,
    )
    t = torch.tensor(
        data.draw(st.lists(st.lists(st.floats(-10, 10), min_size=5, max_size=5), min_size=n, max_size=n)),
        dtype=D,
    )
    a = generalized_jsd(s, t, beta=beta, chunk_size=chunk)
    torch.testing.assert_close(a, naive_jsd(s, t, beta).mean(), rtol=1e-10, atol=1e-12)


def test_topk_kwargs_temperature_mask_reduction_normalizer() -> None:
    s, t = _logits(2, 3, 8, seed=50), _logits(2, 3, 8, seed=51)
    mask = torch.tensor([[1, 0, 1], [1, 1, 0]], dtype=torch.bool)
    none = topk_distill(s, t, k=3, reduction="none", mask=mask)
    assert none.shape == (2, 3) and float(none[~mask].abs().sum()) == 0.0
    assert float(none[mask].min()) > 0
    assert topk_distill(s, t, k=3, mask=mask).item() == pytest.approx(none[mask].mean().item(), rel=1e-12)
    assert topk_distill(s, t, k=3, mask=mask, reduction="sum").item() == pytest.approx(
        none.sum().item(), rel=1e-12
    )
    assert topk_distill(s, t, k=3, mask=mask, normalizer=8).item() == pytest.approx(
        none.sum().item() / 8, rel=1e-12
    )
    torch.testing.assert_close(topk_distill(s, t, k=3, temperature=2.0), topk_distill(s / 2, t / 2, k=3))
    assert topk_distill(s, t, k=3, temperature=2.0).item() != pytest.approx(
        topk_distill(s, t, k=3).item(), rel=1e-3
    )


def test_fused_normalizer_and_mask() -> None:
    h, ht, w = _logits(2, 3, 4, seed=52), _logits(2, 3, 4, seed=53), _logits(6, 4, seed=54)
    mask = torch.tensor([[1, 0, 1], [0, 0, 1]], dtype=torch.bool)
    total = fused_linear_generalized_jsd(h, w, ht, mask=mask, reduction="sum")
    ref = naive_jsd(h @ w.T, ht @ w.T, 0.5)[mask].sum()
    torch.testing.assert_close(total, ref)
    assert fused_linear_generalized_jsd(h, w, ht, mask=mask, normalizer=12).item() == pytest.approx(
        ref.item() / 12, rel=1e-12
    )


def test_fused_low_precision_inputs() -> None:
    h32, ht32, w32 = (
        _logits(6, 8, seed=60).float(),
        _logits(6, 8, seed=61).float(),
        _logits(20, 8, seed=62).float(),
    )
    h = h32.bfloat16().requires_grad_(True)
    w = w32.bfloat16().requires_grad_(True)
    out = fused_linear_generalized_jsd(h, w, ht32.bfloat16(), chunk_size=4)
    assert out.dtype == torch.float32
    out.backward()
    assert h.grad is not None and h.grad.dtype == torch.bfloat16
    assert w.grad is not None and w.grad.dtype == torch.bfloat16
    h_ref = h.detach().float().requires_grad_(True)
    w_ref = w.detach().float().requires_grad_(True)
    ref = naive_jsd(h_ref @ w_ref.T, ht32.bfloat16().float() @ w_ref.detach().T, 0.5).mean()
    ref.backward()
    assert out.item() == pytest.approx(ref.item(), rel=1e-5)
    assert h_ref.grad is not None and w_ref.grad is not None
    torch.testing.assert_close(h.grad.float(), h_ref.grad, rtol=2e-2, atol=2e-3)
    torch.testing.assert_close(w.grad.float(), w_ref.grad, rtol=2e-2, atol=2e-3)


@pytest.mark.parametrize("beta", [0.1, 0.5, 0.9])
def test_identical_distributions_are_exactly_zero_in_float32_at_interior_beta(beta: float) -> None:
    # The mixture log m is computed around the larger log-prob, so p == q gives log m == log p bit-exactly:
    # hinted context == plain context must give an SDPO channel of exactly 0 (not a rounding residue).
    torch.manual_seed(0)
    z = (torch.randn(2, 5, 301) * 4).requires_grad_(True)
    value = generalized_jsd(z, z.detach().clone(), beta=beta, chunk_size=3)
    (grad,) = torch.autograd.grad(value, z)
    assert value.item() == 0.0
    assert torch.count_nonzero(grad).item() == 0
    # top-k runs through autograd: the value is exact, the gradient's cancellation leaves only rounding
    value = topk_distill(z, z.detach().clone(), k=7, beta=beta)
    (grad,) = torch.autograd.grad(value, z)
    assert value.item() == 0.0
    assert grad.abs().max().item() < 1e-6  # float32 rounding
    h = torch.randn(2, 5, 16, requires_grad=True)
    w = torch.randn(301, 16, requires_grad=True)
    value = fused_linear_generalized_jsd(h, w, h.detach().clone(), beta=beta, chunk_size=4)
    gh, gw = torch.autograd.grad(value, (h, w))
    assert value.item() == 0.0
    assert torch.count_nonzero(gh).item() == 0 and torch.count_nonzero(gw).item() == 0
