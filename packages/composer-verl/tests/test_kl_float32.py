"""Why a LoRA reference's ``actor/kl_loss`` reads exactly 0.0 in verl 0.9.1 (issue 14's observation).

With ``lora_rank > 0`` verl computes the reference log-probs in the actor with the adapter disabled
(``no_lora_adapter`` → ``engine.disable_adapter()``). PEFT initialises LoRA ``B = 0``, so at step 1 the policy
*is* the reference: KL = 0 exactly. Afterwards the policy differs from the reference only by the LoRA update;
with small learning rates the per-token log-prob gap d stays below ~3e-4, and verl's default
``kl_loss_type=low_var_kl`` evaluates ``exp(d) − d − 1`` in float32, where the true value d²/2 (< 5e-8) is
below float32 resolution around 1: the result is exactly 0.0. These tests pin that arithmetic on verl's own
``kl_penalty``; KL is positive once the gap exceeds float32 resolution (or in float64).
"""

from __future__ import annotations

import pytest
import torch
from verl.trainer.ppo.core_algos import kl_penalty


@pytest.mark.parametrize("gap", [1e-6, 1e-5, 1e-4, 3e-4])
def test_low_var_kl_is_exactly_zero_in_float32_for_small_gaps(gap: float) -> None:
    lp = torch.full((8,), -1.0, dtype=torch.float32)
    assert torch.all(kl_penalty(lp, lp + gap, "low_var_kl") == 0.0)
    exact = kl_penalty(lp.double(), lp.double() + gap, "low_var_kl")
    assert torch.allclose(exact, torch.full_like(exact, gap**2 / 2), rtol=1e-3)  # the value that was lost


@pytest.mark.parametrize("gap", [1e-3, 1e-2, 1e-1])
def test_low_var_kl_is_positive_once_the_gap_is_resolvable(gap: float) -> None:
    lp = torch.full((8,), -1.0, dtype=torch.float32)
    kl = kl_penalty(lp, lp + gap, "low_var_kl")
    assert torch.all(kl > 0)
    assert torch.allclose(kl.double(), torch.full((8,), gap**2 / 2, dtype=torch.float64), rtol=0.2)


def test_identical_policy_and_reference_give_exactly_zero() -> None:
    """Step 1 with LoRA (B = 0): log-probs equal bit for bit, every KL estimator is 0."""
    lp = torch.randn(16, dtype=torch.float32)
    for kind in ("kl", "abs", "mse", "low_var_kl"):
        assert torch.all(kl_penalty(lp, lp.clone(), kind) == 0.0), kind
