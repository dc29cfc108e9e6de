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
