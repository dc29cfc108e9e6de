"""float64 ``torch.autograd.gradcheck`` of ``composer_loss`` wrt ``trainer_logprobs``.

Token values sit away from the DPPO mask and PPO clip boundaries, where the loss is
smooth; masked / clipped tokens and out-of-mask tokens are included.
"""

from __future__ import annotations

import math

import pytest
import torch
from composer_prime_rl import LossInputs, composer_loss

P_TRAIN = [0.9, 0.9, 0.3, 0.55, 0.7, 0.05, 0.4]
P_INF = [0.6, 0.6, 0.6, 0.6, 0.65, 0.5, 0.4]
ADV = [1.0, -1.0, -0.7, 0.4, 1.5, 2.0, -3.0]
MASK = [True, True, True, True, True, True, False]
WEIGHTS = [1.0, 0.5, 2.0, 1.5, 1.0, 0.25, 3.0]


def _log(values: list[float]) -> torch.Tensor:
    return torch.tensor([math.log(v) for v in values], dtype=torch.float64)


@pytest.mark.parametrize(
    "kwargs",
    [
        {},
        {"kl_tau": 0.05, "adv_tau": 0.7, "dppo_mask_low": 0.1, "dppo_mask_high": 0.25},
        {"policy_loss": "clipped_surrogate"},
        {"policy_loss": "clipped_surrogate", "epsilon_low": 0.1, "epsilon_high": 0.3, "delta": 2.0},
    ],
)
@pytest.mark.parametrize("weighted", [False, True])
def test_gradcheck_policy_losses(kwargs, weighted) -> None:
    def f(lp: torch.Tensor) -> torch.Tensor:
        inputs = LossInputs(
            trainer_logprobs=lp,
            inference_logprobs=_log(P_INF),
            ref_logprobs=None,
            advantages=torch.tensor(ADV, dtype=torch.float64),
            loss_mask=torch.tensor(MASK),
            loss_weights=torch.tensor(WEIGHTS, dtype=torch.float64) if weighted else None,
        )
        return composer_loss(inputs, **kwargs).loss

    lp = _log(P_TRAIN).requires_grad_(True)
    assert torch.autograd.gradcheck(f, (lp,), eps=1e-6, atol=1e-8, rtol=1e-6)


P_REF = [0.5, 0.95, 0.2, 0.3, 0.7, 0.1, 0.6]


@pytest.mark.parametrize("policy", ["dppo", "clipped_surrogate"])
@pytest.mark.parametrize("clip", [2.0, 1.1, None])
def test_sdpo_gradient_matches_finite_differences_of_its_potential(policy, clip) -> None:
    """Channel 2's value is the k1 estimate w·(ℓ − ℓ_ref), a surrogate whose gradient is
    w·(ℓ − ℓ_ref)·∇ℓ by design, so gradcheck on the value does not apply. Instead: the full
    gradient must equal central finite differences (float64) of the potential
    Φ(ℓ) = composer_loss(ℓ, alpha_sdpo=0) + α·Σ_t m_t·u_t·w_t·(ℓ_t − ℓ_ref,t)²/2, w frozen at ℓ0."""
    alpha = 0.7
    weights = torch.tensor(WEIGHTS, dtype=torch.float64)
    mask = torch.tensor(MASK)
    lp_inf, lp_ref = _log(P_INF), _log(P_REF)
    lp0 = _log(P_TRAIN)

    def inputs(lp: torch.Tensor) -> LossInputs:
        return LossInputs(lp, lp_inf, lp_ref, torch.tensor(ADV, dtype=torch.float64), mask, weights)

    base = {"policy_loss": policy}
    lp = lp0.clone().requires_grad_(True)
    composer_loss(inputs(lp), **base, alpha_sdpo=alpha, sdpo_token_clip=clip).loss.backward()

    is_weight = torch.exp(lp0 - lp_inf)
    is_weight = torch.ones_like(is_weight) if clip is None else is_weight.clamp(max=clip)

    def potential(x: torch.Tensor) -> float:
        policy_value = composer_loss(inputs(x), **base).loss
        sdpo = (mask * weights * is_weight * (x - lp_ref) ** 2 / 2).sum()
        return float(policy_value + alpha * sdpo)

    eps = 1e-6
    numeric = torch.zeros_like(lp0)
    for i in range(lp0.shape[0]):
        step = torch.zeros_like(lp0)
        step[i] = eps
        numeric[i] = (potential(lp0 + step) - potential(lp0 - step)) / (2 * eps)
    torch.testing.assert_close(lp.grad, numeric, rtol=1e-6, atol=1e-8)
    assert lp.grad[~mask].eq(0).all()
