"""Channel 1, ``policy_loss = "dppo"``: PRIME-RL's default DPPO + KL loss, closed-form values.

Check values from loss-math.md §3: p_train = 0.9, p_inf = 0.6 (Δp = +0.3) is masked when
A > 0 and kept when A < 0; the mirror case p_train = 0.3, p_inf = 0.6 (Δp = −0.3) is
masked when A ≤ 0 and kept when A > 0. Per token L = −1[kept]·adv_tau·A·ρ + kl_tau·δ².
"""

from __future__ import annotations

import math

import pytest
import torch
from composer_prime_rl import composer_loss

KL_TAU = 1e-3


def _expected(
    p_train: float, p_inf: float, adv: float, kept: bool, adv_tau: float = 1.0, kl_tau: float = KL_TAU
):
    """(loss, d loss / d ℓ_train) of one token, by hand."""
    delta = math.log(p_train) - math.log(p_inf)
    rho = math.exp(delta)
    loss = (-adv_tau * adv * rho if kept else 0.0) + kl_tau * delta**2
    grad = (-adv_tau * adv * rho if kept else 0.0) + 2 * kl_tau * delta
    return loss, grad


@pytest.mark.parametrize(
    ("p_train", "p_inf", "adv", "kept"),
    [
        (0.9, 0.6, +1.0, False),  # Δp = +0.3 > 0.2 with A > 0: probability rose too far -> masked
        (0.9, 0.6, -1.0, True),  # same Δp with A < 0: the low bound applies -> kept
        (0.3, 0.6, -1.0, False),  # Δp = −0.3 < −0.2 with A < 0 -> masked
        (0.3, 0.6, +1.0, True),  # same Δp with A > 0: the high bound applies -> kept
        (0.5, 0.6, +2.0, True),  # |Δp| = 0.1 inside both bounds -> kept
        (0.7, 0.6, -0.5, True),
    ],
)
def test_dppo_mask_cases_on_both_advantage_signs(make_inputs, p_train, p_inf, adv, kept) -> None:
    inputs = make_inputs(p_train=[p_train], p_inf=[p_inf], adv=[adv])
    out = composer_loss(inputs)
    loss, grad = _expected(p_train, p_inf, adv, kept)
    assert out.loss.item() == pytest.approx(loss, rel=1e-12, abs=1e-15)
    out.loss.backward()
    assert inputs.trainer_logprobs.grad.item() == pytest.approx(grad, rel=1e-12, abs=1e-15)
    assert out.metrics["is_masked"].item() == float(not kept)
    assert out.metrics["is_masked_high"].item() == float(not kept and adv > 0)
    assert out.metrics["is_masked_low"].item() == float(not kept and adv < 0)


def test_zero_advantage_uses_the_low_bound(make_inputs) -> None:
    # PRIME-RL: torch.where(A > 0, high, low) -> A = 0 is judged by the low bound (counted in
    # is_masked) but neither is_masked_low (A < 0) nor is_masked_high (A > 0), as upstream.
    out = composer_loss(make_inputs(p_train=[0.3, 0.9], p_inf=[0.6, 0.6], adv=[0.0, 0.0]))
    assert out.metrics["is_masked"].item() == 0.5
    assert out.metrics["is_masked_low"].item() == 0.0
    assert out.metrics["is_masked_high"].item() == 0.0


def test_sample_sum_and_metrics_over_mixed_tokens(make_inputs) -> None:
    p_train, p_inf, adv = [0.9, 0.9, 0.3, 0.5, 0.2], [0.6, 0.6, 0.6, 0.6, 0.01], [1.0, -1.0, -1.0, 2.0, 3.0]
    mask = [True, True, True, True, False]  # the last token is not an rl token
    kept = [False, True, False, True]
    out = composer_loss(make_inputs(p_train=p_train, p_inf=p_inf, adv=adv, mask=mask))
    expected = sum(_expected(p_train[i], p_inf[i], adv[i], kept[i])[0] for i in range(4))
    assert out.loss.item() == pytest.approx(expected, rel=1e-12)  # a SUM, not a mean
    m = out.metrics
    assert m["is_masked"].item() == pytest.approx(0.5)
    assert m["is_masked_high"].item() == pytest.approx(0.25)
    assert m["is_masked_low"].item() == pytest.approx(0.25)
    assert m["masked_advantage_positive"].item() == pytest.approx(0.5)
    assert m["masked_advantage_negative"].item() == pytest.approx(0.5)

    def k3(pt: float, pi: float) -> float:
        d = math.log(pt / pi)
        return math.exp(d) - d - 1

    assert m["masked_mismatch_kl"].item() == pytest.approx((k3(0.9, 0.6) + k3(0.3, 0.6)) / 2, rel=1e-6)
    assert m["unmasked_mismatch_kl"].item() == pytest.approx((k3(0.9, 0.6) + k3(0.5, 0.6)) / 2, rel=1e-6)
    assert m["composer/loss/policy"].item() == pytest.approx(expected / 4, rel=1e-6)
    assert all(v.dim() == 0 and not v.requires_grad for v in m.values())


@pytest.mark.parametrize(
    ("kwargs", "p_train", "adv", "kept", "adv_tau", "kl_tau"),
    [
        ({"dppo_mask_high": 0.35}, 0.9, +1.0, True, 1.0, KL_TAU),  # default 0.2 masks it
        (
            {"dppo_mask_high": 10.0},
            0.9,
            +1.0,
            True,
            1.0,
            KL_TAU,
        ),  # > 1: never masks (PRIME-RL's tests use 10)
        ({"dppo_mask_low": 0.35}, 0.3, -1.0, True, 1.0, KL_TAU),  # default 0.2 masks it
        ({"dppo_mask_high": 0.05}, 0.7, +1.0, False, 1.0, KL_TAU),  # default 0.2 keeps it
        ({"dppo_mask_low": 0.05}, 0.5, -1.0, False, 1.0, KL_TAU),  # default 0.2 keeps it
        ({"adv_tau": 0.5}, 0.9, -1.0, True, 0.5, KL_TAU),
        ({"kl_tau": 0.0}, 0.9, -1.0, True, 1.0, 0.0),  # drops the squared-log-ratio term
        ({"kl_tau": 0.1}, 0.9, +1.0, False, 1.0, 0.1),
    ],
)
def test_every_dppo_knob_changes_the_loss(make_inputs, kwargs, p_train, adv, kept, adv_tau, kl_tau) -> None:
    inputs = make_inputs(p_train=[p_train], p_inf=[0.6], adv=[adv])
    out = composer_loss(inputs, policy_loss="dppo", **kwargs)
    expected, grad = _expected(p_train, 0.6, adv, kept, adv_tau=adv_tau, kl_tau=kl_tau)
    default, _ = _expected(p_train, 0.6, adv, (p_train - 0.6 <= 0.2) if adv > 0 else (p_train - 0.6 >= -0.2))
    assert expected != pytest.approx(default)  # the knob matters for this token
    assert out.loss.item() == pytest.approx(expected, rel=1e-12, abs=1e-15)
    out.loss.backward()
    assert inputs.trainer_logprobs.grad.item() == pytest.approx(grad, rel=1e-12, abs=1e-15)


def test_loss_weights_scale_each_token_including_the_kl_term(make_inputs) -> None:
    p_train, adv, w = [0.9, 0.9, 0.5], [1.0, -1.0, 2.0], [2.0, 0.5, 0.0]
    inputs = make_inputs(p_train=p_train, p_inf=[0.6] * 3, adv=adv, weights=w)
    out = composer_loss(inputs)
    kept = [False, True, True]
    terms = [_expected(p_train[i], 0.6, adv[i], kept[i]) for i in range(3)]
    assert out.loss.item() == pytest.approx(sum(w[i] * terms[i][0] for i in range(3)), rel=1e-12)
    out.loss.backward()
    expected_grad = torch.tensor([w[i] * terms[i][1] for i in range(3)], dtype=torch.float64)
    torch.testing.assert_close(inputs.trainer_logprobs.grad, expected_grad, rtol=1e-12, atol=1e-15)

    unweighted = composer_loss(make_inputs(p_train=p_train, p_inf=[0.6] * 3, adv=adv, weights=[1.0] * 3))
    assert unweighted.loss.item() == pytest.approx(
        composer_loss(make_inputs(p_train=p_train, p_inf=[0.6] * 3, adv=adv)).loss.item()
    )
