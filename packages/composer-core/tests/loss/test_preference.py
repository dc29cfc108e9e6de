from __future__ import annotations

import math

import pytest
import torch
from composer_core import DPO, SimPO, dpo_loss, simpo_loss

D = torch.float64
Z = torch.zeros(1, dtype=D)


def test_dpo_at_init_is_ln2_for_any_beta() -> None:
    for beta in (0.01, 0.1, 1.0):
        for lt in ("sigmoid", "robust"):
            assert dpo_loss(Z, Z, Z, Z, options=DPO(beta=beta, loss_type=lt)).item() == pytest.approx(
                math.log(2), abs=1e-12
            )  # type: ignore[arg-type]
    assert dpo_loss(Z, Z, Z, Z, options=DPO(label_smoothing=0.2)).item() == pytest.approx(
        math.log(2), abs=1e-12
    )
    assert dpo_loss(Z, Z, Z, Z, options=DPO(loss_type="robust", label_smoothing=0.2)).item() == pytest.approx(
        math.log(2), abs=1e-12
    )


def test_dpo_check_values() -> None:
    h = torch.tensor([10.0], dtype=D)
    assert dpo_loss(h, Z, Z, Z, options=DPO(beta=0.1)).item() == pytest.approx(0.313262, abs=1e-6)
    one = torch.ones(1, dtype=D)
    assert dpo_loss(
        Z, Z, Z, Z, options=DPO(loss_type="ipo", beta=0.1), chosen_lengths=one, rejected_lengths=one
    ).item() == pytest.approx(25.0)


def test_simpo_closed_form() -> None:
    c = torch.tensor([-4.0], dtype=D)
    r = torch.tensor([-9.0], dtype=D)
    out = simpo_loss(c, r, torch.tensor([2]), torch.tensor([3]), options=SimPO(beta=2.0, gamma=0.5))
    x = 2.0 * (-2.0 + 3.0) - 0.5
    assert out.item() == pytest.approx(math.log1p(math.exp(-x)), abs=1e-12)


def _pairs(seed: int = 0, p: int = 4) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(p, generator=g, dtype=D) * 3 for _ in range(4)]


def test_dpo_variants_closed_form() -> None:
    c, r, rc, rr = _pairs()
    h = (c - rc) - (r - rr)
    b, e = 0.3, 0.2
    ls = torch.nn.functional.logsigmoid
    torch.testing.assert_close(dpo_loss(c, r, rc, rr, options=DPO(beta=b), reduction="none"), -ls(b * h))
    torch.testing.assert_close(
        dpo_loss(c, r, rc, rr, options=DPO(beta=b, label_smoothing=e), reduction="none"),
        -(1 - e) * ls(b * h) - e * ls(-b * h),
    )
    torch.testing.assert_close(
        dpo_loss(c, r, rc, rr, options=DPO(beta=b, loss_type="robust", label_smoothing=e), reduction="none"),
        (-(1 - e) * ls(b * h) + e * ls(-b * h)) / (1 - 2 * e),
    )
    lc, lr = torch.tensor([3, 5, 2, 7]), torch.tensor([4, 1, 6, 2])
    h_bar = (c - rc) / lc - (r - rr) / lr
    torch.testing.assert_close(
        dpo_loss(
            c,
            r,
            rc,
            rr,
            options=DPO(beta=b, loss_type="ipo"),
            chosen_lengths=lc,
            rejected_lengths=lr,
            reduction="none",
        ),
        (h_bar - 1 / (2 * b)) ** 2,
    )
    opts = DPO(beta=b)
    full = dpo_loss(c, r, rc, rr, options=opts, reduction="none")
    assert dpo_loss(c, r, rc, rr, options=opts).item() == pytest.approx(full.mean().item())
    assert dpo_loss(c, r, rc, rr, options=opts, reduction="sum").item() == pytest.approx(full.sum().item())
    assert dpo_loss(c, r, rc, rr, options=opts, normalizer=10).item() == pytest.approx(full.sum().item() / 10)


def test_simpo_kwargs_and_no_reference() -> None:
    c, r, _, _ = _pairs(1)
    lc, lr = torch.tensor([3, 5, 2, 7]), torch.tensor([4, 1, 6, 2])
    base = simpo_loss(c, r, lc, lr, reduction="none")
    torch.testing.assert_close(base, -torch.nn.functional.logsigmoid(2.0 * (c / lc - r / lr) - 0.5))
    torch.testing.assert_close(
        simpo_loss(c, r, lc, lr, options=SimPO(beta=1.0, gamma=0.0), reduction="none"),
        -torch.nn.functional.logsigmoid(c / lc - r / lr),
    )
    assert simpo_loss(c, r, lc, lr, normalizer=8).item() == pytest.approx(base.sum().item() / 8)


def test_gradcheck_preference_losses() -> None:
    c, r, rc, rr = (x.requires_grad_(True) for x in _pairs(2))
    lc, lr = torch.tensor([3.0, 5, 2, 7], dtype=D), torch.tensor([4.0, 1, 6, 2], dtype=D)
    for kw in ({}, {"label_smoothing": 0.1}, {"loss_type": "robust", "label_smoothing": 0.1}):
        opts = DPO(**kw)  # type: ignore[arg-type]
        assert torch.autograd.gradcheck(lambda a, b, opts=opts: dpo_loss(a, b, rc, rr, options=opts), (c, r))
    ipo = DPO(loss_type="ipo")
    assert torch.autograd.gradcheck(
        lambda a, b: dpo_loss(a, b, rc, rr, options=ipo, chosen_lengths=lc, rejected_lengths=lr), (c, r)
    )
    assert torch.autograd.gradcheck(lambda a, b: simpo_loss(a, b, lc, lr), (c, r))
    # the reference is detached: no gradient flows to it
    dpo_loss(c, r, rc, rr).backward()
    assert rc.grad is None and rr.grad is None


def test_preference_bad_inputs() -> None:
    c, r, rc, rr = _pairs(3)
    one = torch.ones(4)
    cases: list[tuple[object, str]] = [
        (lambda: dpo_loss(c, r[:3], rc, rr), r"rejected_logps.*shape"),
        (lambda: dpo_loss(c * float("nan"), r, rc, rr), r"chosen_logps.*NaN"),
        (lambda: DPO(beta=0.0), r"beta"),
        (lambda: DPO(loss_type="hinge"), r"loss_type"),  # type: ignore[arg-type]
        (lambda: dpo_loss(c, r, rc, rr, options=DPO(loss_type="ipo")), r"chosen_lengths"),
        (lambda: DPO(loss_type="ipo", label_smoothing=0.1), r"label_smoothing"),
        (
            lambda: dpo_loss(c, r, rc, rr, chosen_lengths=one, rejected_lengths=one),
            r"only used by loss_type='ipo'",
        ),
        (lambda: dpo_loss(c, r, rc, rr, chosen_lengths=one), r"only used by loss_type='ipo'"),  # one of them
        (lambda: DPO(label_smoothing=0.7), r"label_smoothing"),
        (lambda: DPO(loss_type="robust", label_smoothing=0.5), r"label_smoothing"),
        (lambda: dpo_loss(c, r, rc, rr, reduction="sum", normalizer=3), r"normalizer"),
        (lambda: dpo_loss(c[:0], r[:0], rc[:0], rr[:0]), r"no preference pair"),
        (lambda: simpo_loss(c, r, one, one * 0), r"rejected_lengths"),
        (lambda: SimPO(gamma=-1.0), r"gamma"),
        (lambda: simpo_loss(c, r, one[:2], one), r"chosen_lengths.*shape"),
    ]
    for fn, match in cases:
        assert callable(fn)
        with pytest.raises(ValueError, match=match):
            fn()
