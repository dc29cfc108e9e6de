from __future__ import annotations

import math

import pytest
import torch
from composer_core import TAIDScheduler, entropy_opd_loss, generalized_jsd, taid_loss

D = torch.float64


def test_taid_t0_zero_and_t1_forward_kl() -> None:
    g = torch.Generator().manual_seed(0)
    s = torch.randn(4, 7, generator=g, dtype=D).requires_grad_(True)
    t = torch.randn(4, 7, generator=g, dtype=D)
    v0 = taid_loss(s, t, 0.0)
    (g0,) = torch.autograd.grad(v0, s)
    assert v0.item() == pytest.approx(0.0, abs=1e-14) and g0.abs().max().item() < 1e-14
    torch.testing.assert_close(taid_loss(s, t, 1.0), generalized_jsd(s, t, beta=0.0))


def test_taid_scheduler_check_value() -> None:
    sched = TAIDScheduler(total_steps=10**9)
    assert sched.step(1.0) == 0.4
    t = sched.step(0.9)
    assert sched.momentum == pytest.approx(0.001)
    assert t - 0.4 == pytest.approx(1.5007e-4, rel=1e-4)


def test_entropy_opd_gate() -> None:
    s = torch.tensor([[2.0, 0.0]], dtype=D)
    t_low = torch.tensor([[0.0, 0.0]], dtype=D)  # H = ln 2 < 0.8 -> gate closed
    assert entropy_opd_loss(s, t_low).item() == pytest.approx(generalized_jsd(s, t_low).item(), abs=1e-14)
    s3 = torch.tensor([[2.0, 0.0, -1.0]], dtype=D)
    t_uni = torch.zeros(1, 3, dtype=D)  # H = ln 3 > 0.8 -> FKL added
    expected = generalized_jsd(s3, t_uni) + generalized_jsd(s3, t_uni, beta=0.0)
    assert entropy_opd_loss(s3, t_uni).item() == pytest.approx(expected.item(), abs=1e-12)
    assert math.log(3) > 0.8 > math.log(2)


def _pair(seed: int, *shape: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g, dtype=D), torch.randn(*shape, generator=g, dtype=D)


def test_taid_intermediate_t_closed_form_and_grad() -> None:
    s, t = _pair(1, 3, 4, 6)
    s.requires_grad_(True)
    mask = torch.tensor([[1, 1, 0, 1], [0, 1, 1, 1], [1, 0, 0, 0]], dtype=torch.bool)
    out = taid_loss(s, t, 0.3, mask=mask, chunk_size=2, temperature=1.5)
    zs, zt = s / 1.5, t / 1.5
    target = torch.log_softmax(0.7 * zs.detach() + 0.3 * zt, -1)
    ref = (target.exp() * (target - torch.log_softmax(zs, -1))).sum(-1)[mask].mean()
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(torch.autograd.grad(out, s)[0], torch.autograd.grad(ref, s)[0])
    none = taid_loss(s, t, 0.3, mask=mask, reduction="none", temperature=1.5)
    assert none.shape == (3, 4) and float(none.detach()[~mask].abs().sum()) == 0.0
    assert taid_loss(s, t, 0.3, mask=mask, reduction="sum", temperature=1.5).item() == pytest.approx(
        ref.item() * 7, rel=1e-12
    )
    assert taid_loss(s, t, 0.3, mask=mask, normalizer=14, temperature=1.5).item() == pytest.approx(
        ref.item() / 2, rel=1e-12
    )


def test_gradcheck_taid_and_eopd() -> None:
    s, t = _pair(2, 3, 6)
    s.requires_grad_(True)
    # TAID stops the gradient through the target's student part. For a float64 gradcheck that is still a
    # check of the true derivative, feed a teacher that keeps the interpolated target fixed:
    # (1−t)·x + t·(target − (1−t)·x)/t = target, so the value is KL(softmax(target)‖q(x)) exactly.
    target = torch.randn(3, 6, dtype=D, generator=torch.Generator().manual_seed(9))
    tt = 0.6
    assert torch.autograd.gradcheck(
        lambda x: taid_loss(x, (target - (1 - tt) * x) / tt, tt, chunk_size=2), (s,)
    )
    for topk in (None, 2):
        assert torch.autograd.gradcheck(
            lambda x, k=topk: entropy_opd_loss(x, t, threshold=0.5, topk=k, chunk_size=2, beta=0.3), (s,)
        )


def test_entropy_opd_topk_is_truncated_not_renormalised() -> None:
    s = torch.tensor([[1.0, 0.0, -1.0, 0.5]], dtype=D)
    t = torch.tensor([[0.3, 0.2, 0.1, 0.0]], dtype=D)  # high entropy: gate open
    lp, lq = torch.log_softmax(t, -1), torch.log_softmax(s, -1)
    top = [0, 1]
    fkl_top = sum(lp[0, i].exp() * (lp[0, i] - lq[0, i]) for i in top)
    base = generalized_jsd(s, t, beta=1.0)
    out = entropy_opd_loss(s, t, topk=2, beta=1.0, fkl_weight=0.5)
    assert out.item() == pytest.approx((base + 0.5 * fkl_top).item(), abs=1e-12)


def test_entropy_opd_kwargs_threshold_weight_temperature_mask() -> None:
    s, t = _pair(3, 2, 5, 8)
    lp = torch.log_softmax(t, -1)
    ent = -(lp.exp() * lp).sum(-1)
    thr = float(ent.median())
    gate = (ent > thr).to(D)
    base = generalized_jsd(s, t, beta=0.5, reduction="none")
    fkl = generalized_jsd(s, t, beta=0.0, reduction="none")
    out = entropy_opd_loss(s, t, threshold=thr, fkl_weight=2.0, reduction="none")
    torch.testing.assert_close(out, base + 2.0 * gate * fkl)
    assert 0 < int(gate.sum()) < 10
    # topk is checked against V (the last dim, 8), not another dim of a [B, T, V] input (T = 5): topk=V is full
    full = entropy_opd_loss(s, t, threshold=thr, fkl_weight=2.0, topk=8, reduction="none")
    torch.testing.assert_close(full, out)
    # temperature scales both sides and enters the entropy
    out_t = entropy_opd_loss(s, t, threshold=thr, temperature=2.0)
    assert out_t.item() == pytest.approx(entropy_opd_loss(s / 2, t / 2, threshold=thr).item(), rel=1e-12)
    mask = torch.zeros(2, 5, dtype=torch.bool)
    mask[0, :2] = True
    assert entropy_opd_loss(s, t, threshold=thr, mask=mask).item() == pytest.approx(
        (base + gate * fkl)[mask].mean().item(), rel=1e-12
    )


def test_wrapper_bad_inputs() -> None:
    s, t = _pair(4, 2, 5)
    with pytest.raises(ValueError, match="`t`"):
        taid_loss(s, t, 1.2)
    with pytest.raises(ValueError, match="topk"):
        entropy_opd_loss(s, t, topk=6)
    with pytest.raises(ValueError, match="threshold"):
        entropy_opd_loss(s, t, threshold=-1.0)
    with pytest.raises(ValueError, match="fkl_weight"):
        entropy_opd_loss(s, t, fkl_weight=-1.0)
    with pytest.raises(ValueError, match=r"teacher_logits.*shape"):
        taid_loss(s, t[:, :4], 0.5)


# ------------------------------------------------------------------ scheduler
def test_taid_scheduler_linear_floor_cap_and_kwargs() -> None:
    sched = TAIDScheduler(total_steps=10, t_start=0.2, t_end=0.8, alpha=0.0)
    ts = [sched.step(1.0) for _ in range(12)]
    # alpha=0: pure linear floor t_start + (t_end - t_start)·step/total, capped at t_end
    assert ts[0] == 0.2
    assert ts[4] == pytest.approx(0.2 + 0.6 * 4 / 10)  # the 5th step is global step 4 (0-based)
    assert ts[-1] == pytest.approx(0.8)
    fast = TAIDScheduler(total_steps=10**6, alpha=0.5, beta=0.0)
    fast.step(1.0)
    t = fast.step(0.5)  # δ=0.5, m=0.5 (beta 0), Δt = 0.5·σ(0.5)·0.6
    assert t == pytest.approx(0.4 + 0.5 * (1 / (1 + math.exp(-0.5))) * 0.6)
    # a rising loss gives negative momentum: Δt shrinks but t never drops below the floor
    rising = TAIDScheduler(total_steps=10**6, alpha=0.5, beta=0.0)
    rising.step(1.0)
    assert rising.step(2.0) == pytest.approx(0.4 + 0.5 * (1 / (1 + math.exp(1.0))) * 0.6)


def _taid_reference(
    losses: list[float], num_train_steps: int, t_start: float, t_end: float, alpha: float, beta: float
) -> list[float]:
    """The update rule of the TAID reference (SakanaAI/TAID ``src/distil_losses/taid.py``, ``TAID.update_t``),
    transcribed as a formula. It runs once per training step, after the loss of step ``global_step`` (0-based,
    Lightning's count of optimiser steps done before it) was computed with the current t:

    - first call: remember J, t unchanged;
    - then δ = (J_prev − J)/(J_prev + 1e-15), m ← β·m + (1−β)·δ,
      t ← min(t_end, max(t_start + (t_end − t_start)·global_step/num_train_steps, t + α·σ(m)·(1 − t))).
    """
    t, m, prev, out = t_start, 0.0, None, []
    for global_step, loss in enumerate(losses):
        if prev is not None:
            m = beta * m + (1 - beta) * (prev - loss) / (prev + 1e-15)
            target = t_start + (t_end - t_start) * global_step / num_train_steps
            t = min(t_end, max(target, t + alpha * (1 / (1 + math.exp(-m))) * (1 - t)))
        prev = loss
        out.append(t)
    return out


@pytest.mark.parametrize(
    ("total", "alpha", "beta"), [(6, 5e-4, 0.99), (6, 0.0, 0.99), (40, 0.3, 0.5), (3, 0.05, 0.0)]
)
def test_taid_scheduler_matches_reference_update_rule(total: int, alpha: float, beta: float) -> None:
    """The linear floor uses the 0-based step (reference), not one step ahead; momentum and Δt as the reference."""
    losses = [2.0, 1.7, 1.75, 1.2, 1.1, 1.15, 0.9, 0.8, 0.85, 0.7]
    sched = TAIDScheduler(total_steps=total, t_start=0.3, t_end=0.9, alpha=alpha, beta=beta)
    ours = [sched.step(j) for j in losses]
    ref = _taid_reference(losses, total, 0.3, 0.9, alpha, beta)
    assert ours == pytest.approx(ref, rel=1e-12, abs=1e-15)


def test_taid_scheduler_state_roundtrip_and_errors() -> None:
    a = TAIDScheduler(total_steps=100)
    for j in (1.0, 0.8, 0.7):
        a.step(torch.tensor(j))
    b = TAIDScheduler(total_steps=100)
    b.load_state_dict(a.state_dict())
    assert b.step(0.6) == a.step(0.6)
    with pytest.raises(ValueError, match="not finite"):
        a.step(float("nan"))
    with pytest.raises(ValueError, match="scalar"):
        a.step(torch.ones(2))
    with pytest.raises(ValueError, match="missing"):
        b.load_state_dict({"t": 0.5})
    with pytest.raises(ValueError, match="corrupt"):
        b.load_state_dict({**a.state_dict(), "t": 3.0})
    with pytest.raises(ValueError, match="total_steps"):
        TAIDScheduler(0)
    with pytest.raises(ValueError, match="t_start"):
        TAIDScheduler(10, t_start=0.9, t_end=0.5)


def test_entropy_opd_normalizer_and_sum() -> None:
    s, t = _pair(5, 2, 3, 6)
    none = entropy_opd_loss(s, t, threshold=0.0, reduction="none")
    assert entropy_opd_loss(s, t, threshold=0.0, reduction="sum").item() == pytest.approx(
        none.sum().item(), rel=1e-12
    )
    assert entropy_opd_loss(s, t, threshold=0.0, normalizer=12).item() == pytest.approx(
        none.sum().item() / 12, rel=1e-12
    )
