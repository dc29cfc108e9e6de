"""Channel 1, ``policy_loss = "clipped_surrogate"``: PPO/GRPO clip with ρ = π_train / π_inf.

Per token L = −min(ρA, clip(ρ, 1 − ε_low, 1 + ε_high)·A), with ``delta`` capping ρ in the
unclipped branch (TRL's two-sided clipping). Gradient wrt ℓ_train: −ρA where the unclipped
branch is active (and ρ < delta), else 0. No squared-log-ratio term in this mode.
"""

from __future__ import annotations

import math

import pytest
from composer_prime_rl import composer_loss


@pytest.mark.parametrize(
    ("rho", "adv", "kwargs", "loss", "grad", "clipped"),
    [
        (1.5, +1.0, {}, -1.2, 0.0, True),  # ratio above 1 + 0.2 with A > 0: clipped, no gradient
        (1.5, -1.0, {}, 1.5, 1.5, False),  # A < 0: the unclipped branch is the min -> gradient −ρA
        (0.5, -1.0, {}, 0.8, 0.0, True),  # ratio below 1 − 0.2 with A < 0: clipped
        (0.5, +1.0, {}, -0.5, -0.5, False),
        (1.1, +2.0, {}, -2.2, -2.2, False),  # inside the trust region
        (1.25, +1.0, {"epsilon_high": 0.28}, -1.25, -1.25, False),  # default ε_high = ε_low clips it
        (1.25, +1.0, {"epsilon_low": 0.1}, -1.1, 0.0, True),  # ε_low also sets ε_high when unset
        (0.85, -1.0, {"epsilon_low": 0.1}, 0.9, 0.0, True),
        (4.0, -1.0, {"delta": 3.0}, 3.0, 0.0, False),  # delta caps the unclipped ratio
        (2.5, -1.0, {"delta": 3.0}, 2.5, 2.5, False),  # below delta: unchanged
    ],
)
def test_clipped_surrogate_closed_form(make_inputs, rho, adv, kwargs, loss, grad, clipped) -> None:
    inputs = make_inputs(lp_train=[math.log(rho) - 1.0], lp_inf=[-1.0], adv=[adv])
    out = composer_loss(inputs, policy_loss="clipped_surrogate", **kwargs)
    assert out.loss.item() == pytest.approx(loss, rel=1e-12)
    out.loss.backward()
    assert inputs.trainer_logprobs.grad.item() == pytest.approx(grad, rel=1e-12, abs=1e-15)
    assert out.metrics["composer/policy/clip_ratio"].item() == float(clipped)


def test_clipped_surrogate_is_not_dppo(make_inputs) -> None:
    # p_train 0.9 vs p_inf 0.6 (ρ = 1.5), A = +1: DPPO masks the token (loss = KL only),
    # the clipped surrogate clips the ratio at 1.2 instead.
    args = {"p_train": [0.9], "p_inf": [0.6], "adv": [1.0]}
    dppo = composer_loss(make_inputs(**args)).loss.item()
    surrogate = composer_loss(make_inputs(**args), policy_loss="clipped_surrogate").loss.item()
    assert dppo == pytest.approx(1e-3 * math.log(1.5) ** 2, rel=1e-12)
    assert surrogate == pytest.approx(-1.2, rel=1e-12)


def test_sum_and_weights_and_metrics(make_inputs) -> None:
    rhos, adv, w = [1.5, 1.5, 1.0], [1.0, -1.0, 3.0], [1.0, 2.0, 0.5]
    inputs = make_inputs(lp_train=[math.log(r) - 2 for r in rhos], lp_inf=[-2.0] * 3, adv=adv, weights=w)
    out = composer_loss(inputs, policy_loss="clipped_surrogate")
    assert out.loss.item() == pytest.approx(1.0 * -1.2 + 2.0 * 1.5 + 0.5 * -3.0, rel=1e-12)
    assert out.metrics["composer/policy/clip_ratio"].item() == pytest.approx(1 / 3)
    k3 = 1.5 - math.log(1.5) - 1
    assert out.metrics["mismatch_kl"].item() == pytest.approx(2 * k3 / 3, rel=1e-6)
    assert set(out.metrics) == {
        "composer/policy/clip_ratio",
        "mismatch_kl",
        "composer/loss/policy",
        "composer/loss/total",
    }
