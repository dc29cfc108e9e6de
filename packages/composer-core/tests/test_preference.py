from __future__ import annotations

import math

import pytest
import torch
from composer_core import dpo_loss, simpo_loss

D = torch.float64
Z = torch.zeros(1, dtype=D)


def test_dpo_at_init_is_ln2_for_any_beta() -> None:
    for beta in (0.01, 0.1, 1.0):
        for lt in ("sigmoid", "robust"):
            assert dpo_loss(Z, Z, Z, Z, beta=beta, loss_type=lt).item() == pytest.approx(
                math.log(2), abs=1e-12
            )  # type: ignore[arg-type]
    assert dpo_loss(Z, Z, Z, Z, label_smoothing=0.2).item() == pytest.approx(math.log(2), abs=1e-12)
    assert dpo_loss(Z, Z, Z, Z, loss_type="robust", label_smoothing=0.2).item() == pytest.approx(
        math.log(2), abs=1e-12
    )


def test_dpo_check_values() -> None:
    h = torch.tensor([10.0], dtype=D)
    assert dpo_loss(h, Z, Z, Z, beta=0.1).item() == pytest.approx(0.313262, abs=1e-6)
    one = torch.ones(1, dtype=D)
    assert dpo_loss(
        Z, Z, Z, Z, loss_type="ipo", beta=0.1, chosen_lengths=one, rejected_lengths=one
    ).item() == pytest.approx(25.0)


def test_simpo_closed_form() -> None:
    c = torch.tensor([-4.0], dtype=D)
    r = torch.tensor([-9.0], dtype=D)
    out = simpo_loss(c, r, torch.tensor([2]), torch.tensor([3]), beta=2.0, gamma=0.5)
    x = 2.0 * (-2.0 + 3.0) - 0.5
    assert out.item() == pytest.approx(math.log1p(math.exp(-x)), abs=1e-12)
