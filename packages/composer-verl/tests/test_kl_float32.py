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


def _lora_run(lr: float, steps: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Tiny Qwen2 + PEFT LoRA (B = 0 at init, as verl's ``lora_rank > 0``); ``steps`` SGD steps of ``lr`` on the
    sequences' NLL; returns per-token log-probs of the policy and of the reference (adapter disabled, as verl's
    ``no_lora_adapter``)."""
    from composer_core.tasks.tiny import TinyModelConfig, build_tiny_qwen2
    from peft import LoraConfig, get_peft_model

    base = build_tiny_qwen2(64, TinyModelConfig(hidden_size=32, intermediate_size=64), seed=0)
    model = get_peft_model(
        base, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"])
    )
    ids = torch.randint(3, 64, (4, 12), generator=torch.Generator().manual_seed(0))

    def logps() -> torch.Tensor:
        logits = model(input_ids=ids).logits[:, :-1].float()
        return torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None])[..., 0]

    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=lr)
    for _ in range(steps):
        opt.zero_grad()
        (-logps().mean()).backward()
        opt.step()
    with torch.no_grad():
        policy = logps()
        with model.disable_adapter():
            ref = logps()
    return policy, ref


def test_lora_reference_kl_is_zero_at_step_one_and_positive_once_the_adapter_has_moved() -> None:
    """The mechanism on real PEFT + verl's ``kl_penalty``: KL must be > 0 once the policy moved from the reference."""
    policy, ref = _lora_run(lr=0.0, steps=0)
    assert torch.equal(policy, ref)  # B = 0: the policy is the reference bit for bit
    assert torch.all(kl_penalty(policy, ref, "low_var_kl") == 0.0)

    policy, ref = _lora_run(lr=0.5, steps=3)
    gap = (ref - policy).abs()
    kl = kl_penalty(policy, ref, "low_var_kl")
    assert gap.max() > 1e-2, gap.max()  # the adapter moved the policy
    assert torch.all(kl[gap > 1e-3] > 0)  # resolvable gaps give a positive KL ...
    assert kl.mean() > 1e-6, kl.mean()
    exact = kl_penalty(policy.double(), ref.double(), "low_var_kl")
    assert torch.allclose(kl.double(), exact, rtol=0.05, atol=1e-7)  # ... equal to the float64 value

    policy, ref = _lora_run(lr=1e-4, steps=1)  # a barely moved adapter: the float32 quantisation
    tiny = (ref - policy).abs() < 1e-4
    assert tiny.any()
    assert torch.all(kl_penalty(policy, ref, "low_var_kl")[tiny] == 0.0)
    assert torch.all(kl_penalty(policy.double(), ref.double(), "low_var_kl")[tiny & (policy != ref)] > 0)
