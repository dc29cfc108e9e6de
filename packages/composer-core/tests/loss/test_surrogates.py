"""Closed-form values and float64 gradchecks of the loss types beyond the PPO clip (CISPO, SAPO, VESPO, LUSPO), GSPO's
sequence-level ratio and the surrogate mask. TRL equality of each is tested by composer-trl's swap test."""

from __future__ import annotations

import math

import pytest
import torch
from composer_core.loss.config import ComposeConfig, PolicyOptions
from composer_core.loss.policy import policy_loss

D = torch.float64


def _lp(values: list[list[float]]) -> torch.Tensor:
    return torch.tensor(values, dtype=D).log().requires_grad_(True)


def test_cispo_clips_and_detaches_the_ratio() -> None:
    lp = _lp([[0.5]])
    old = torch.tensor([[0.25]], dtype=D).log()  # ρ = 2 → clipped at ε_hi = 1.5
    out = policy_loss(lp, torch.tensor([1.0], dtype=D), torch.ones(1, 1), old_logprobs=old,
                      options=PolicyOptions(loss_type="cispo", epsilon_high=1.5))  # fmt: skip
    assert out.loss.item() == pytest.approx(-1.5 * math.log(0.5), abs=1e-15)
    (g,) = torch.autograd.grad(out.loss, lp)
    assert g.item() == pytest.approx(
        -1.5, abs=1e-15
    )  # REINFORCE gradient scaled by the detached clipped ratio
    assert out.metrics["policy/clip_ratio"] == 1.0


def test_sapo_soft_clip_value_and_gradient() -> None:
    lp = _lp([[0.5, 0.5]])
    adv = torch.tensor([[2.0, -1.0]], dtype=D)
    out = policy_loss(
        lp, adv, torch.ones(1, 2),
        options=PolicyOptions(loss_type="sapo", sapo_temperature_pos=1.0, sapo_temperature_neg=2.0),
    )  # fmt: skip
    # ρ = 1: σ(0)·4/τ = 2/τ → L = −(2/τ)·A, averaged over the two tokens (grpo-style aggregation)
    assert out.loss.item() == pytest.approx((-2.0 * 2.0 + 1.0 * 1.0) / 2, abs=1e-15)
    (g,) = torch.autograd.grad(out.loss, lp)
    # dS/dℓ = −A·σ'(0)·4 = −A at ρ = 1, / 2 tokens
    assert g.flatten().tolist() == pytest.approx([-1.0, 0.5], abs=1e-15)


def test_vespo_gamma_weight_closed_form() -> None:
    lp = _lp([[0.5, 0.4]])
    old = torch.tensor([[0.4, 0.4]], dtype=D).log()
    adv = torch.tensor([1.0], dtype=D)
    vespo = PolicyOptions(loss_type="vespo")
    out = policy_loss(lp, adv, torch.ones(1, 2), old_logprobs=old, options=vespo)
    s = math.log(0.5 / 0.4)  # Σ_t log ρ_t
    phi = math.exp(3.0 + 2.0 * s - 3.0 * math.exp(s))  # k_pos = 2, λ_pos = 3
    expected = -phi * (math.log(0.5) + math.log(0.4)) / 2  # dapo-style token mean
    assert out.loss.item() == pytest.approx(expected, abs=1e-14)
    assert out.metrics["policy/vespo_phi"] == pytest.approx(phi, abs=1e-14)
    (g,) = torch.autograd.grad(out.loss, lp, retain_graph=True)
    assert g.flatten().tolist() == pytest.approx([-phi / 2, -phi / 2], abs=1e-14)  # φ is detached
    # the rollout IS weight enters φ (log space), not the surrogate
    w = torch.tensor([[2.0, 1.0]], dtype=D)
    out_w = policy_loss(lp, adv, torch.ones(1, 2), old_logprobs=old, options=vespo, rollout_is_weights=w)
    phi_w = math.exp(3.0 + 2.0 * (s + math.log(2.0)) - 3.0 * math.exp(s + math.log(2.0)))
    assert out_w.loss.item() == pytest.approx(-phi_w * (math.log(0.5) + math.log(0.4)) / 2, abs=1e-14)


def test_luspo_sums_each_sequence() -> None:
    lp = _lp([[0.5, 0.5, 0.5], [0.5, 0.5, 0.5]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    adv = torch.tensor([1.0, 2.0], dtype=D)
    out = policy_loss(lp, adv, mask, options=PolicyOptions(loss_type="luspo"))
    assert out.loss.item() == pytest.approx((-3.0 - 2.0) / 2, abs=1e-15)  # mean over sequences of Σ_t −ρA


def test_sequence_level_ratio_is_the_masked_mean_log_ratio() -> None:
    lp = _lp([[0.5, 0.2, 0.9]])
    old = torch.tensor([[0.25, 0.4, 0.1]], dtype=D).log()
    mask = torch.tensor([[1, 1, 0]])
    opts = PolicyOptions(
        loss_type="grpo", importance_sampling_level="sequence", epsilon_low=0.2, epsilon_high=10.0
    )
    out = policy_loss(lp, torch.tensor([1.0], dtype=D), mask, old_logprobs=old, options=opts)
    rho = math.exp((math.log(2.0) + math.log(0.5)) / 2)  # = 1, padding excluded
    assert out.loss.item() == pytest.approx(-rho, abs=1e-15)


def test_surrogate_mask_zeroes_the_surrogate_not_the_denominator() -> None:
    lp = _lp([[0.5, 0.5]])
    keep = torch.tensor([[True, False]])
    out = policy_loss(lp, torch.tensor([1.0], dtype=D), torch.ones(1, 2), surrogate_mask=keep)
    assert out.loss.item() == pytest.approx(-0.5, abs=1e-15)
    with pytest.raises(ValueError, match="surrogate_mask"):
        policy_loss(lp, torch.tensor([1.0], dtype=D), torch.ones(1, 2), surrogate_mask=torch.ones(2, 2))


# CISPO and VESPO detach their weight by design (the gradient is not the derivative of the value): their gradients
# are checked in closed form above, not by finite differences.
@pytest.mark.parametrize("loss_type", ["sapo", "luspo", "grpo"])
@pytest.mark.parametrize("level", ["token", "sequence"])
def test_gradcheck(loss_type: str, level: str) -> None:
    torch.manual_seed(0)
    old = torch.randn(3, 4, dtype=D).clamp(max=-0.1)
    adv = torch.randn(3, dtype=D)
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1]])

    opts = PolicyOptions(loss_type=loss_type, importance_sampling_level=level, epsilon_high=0.28)  # type: ignore[arg-type]

    def f(lp: torch.Tensor) -> torch.Tensor:
        return policy_loss(lp, adv, mask, old_logprobs=old, options=opts).loss

    lp = (old + 0.05 * torch.randn(3, 4, dtype=D)).requires_grad_(True)
    assert torch.autograd.gradcheck(f, (lp,))


def test_options_of_another_loss_type_raise() -> None:
    with pytest.raises(ValueError, match="sapo_temperature_pos"):
        PolicyOptions(loss_type="grpo", sapo_temperature_pos=2.0)
    with pytest.raises(ValueError, match="vespo_k_pos"):
        PolicyOptions(loss_type="sapo", vespo_k_pos=1.0)
    with pytest.raises(ValueError, match="delta"):
        PolicyOptions(loss_type="cispo", delta=3.0)
    with pytest.raises(ValueError, match="importance_sampling_level"):
        PolicyOptions(importance_sampling_level="seq")  # type: ignore[arg-type]
    cfg = ComposeConfig.from_flat(
        loss_type="sapo", sapo_temperature_neg="2.0", importance_sampling_level="sequence"
    )
    assert cfg.policy.sapo_temperature_neg == 2.0 and cfg.policy.importance_sampling_level == "sequence"
