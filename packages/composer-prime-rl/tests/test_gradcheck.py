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
