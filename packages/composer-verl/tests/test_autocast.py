"""The ``composer`` policy loss under mixed precision: one call with all three channels on (channel 2 the
sampled-token SDPO, channel 3 DPO on pairs) under CPU bf16 / fp16 autocast equals the same call in float32
with autocast off, value and gradient, to float32 rounding. verl's FSDP actor computes ``log_prob`` in
float32 inside an autocast region; bf16 log-probs (a bf16 actor without the upcast) are also tried.
"""

from __future__ import annotations

import composer_verl.plugin  # noqa: F401
import pytest
import torch
from composer_verl.batch import ComposerExtras, using_extras
from composer_verl.config import configure
from verl.trainer.ppo.core_algos import get_policy_loss_fn
from verl.workers.config import ActorConfig


def _config() -> ActorConfig:
    return ActorConfig(
        strategy="fsdp", rollout_n=1, ppo_micro_batch_size_per_gpu=2, clip_ratio_low=0.2, clip_ratio_high=0.28
    )


def _inputs(dtype: torch.dtype) -> tuple[dict[str, torch.Tensor], ComposerExtras]:
    g = torch.Generator().manual_seed(0)
    b, t = 4, 6
    old = -torch.rand(b, t, generator=g) * 3 - 0.1
    logp = old + (torch.rand(b, t, generator=g) - 0.5) * 1.5
    mask = torch.ones(b, t, dtype=torch.bool)
    mask[1, 4:] = False
    inputs = {
        "old_log_prob": old,
        "log_prob": logp.to(dtype),
        "advantages": torch.randn(b, generator=g)[:, None].expand(b, t).clone(),
        "response_mask": mask,
    }
    extras = ComposerExtras(
        teacher_log_probs=old - torch.rand(b, t, generator=g),
        sdpo_mask=torch.tensor([[1] * t, [1] * t, [0] * t, [1] * t]),
        pref_pair_id=torch.tensor([0, 0, 1, 1]),
        pref_chosen=torch.tensor([1, 0, 0, 1]),
        pref_ref_log_prob=torch.tensor([-3.0, -2.5, -1.0, -4.0]),
    )
    return inputs, extras


def _run(inputs: dict[str, torch.Tensor], extras: ComposerExtras, amp: torch.dtype | None):
    logp = inputs["log_prob"].detach().clone().requires_grad_()
    fn = get_policy_loss_fn("composer")
    with using_extras(extras), torch.autocast("cpu", dtype=amp or torch.bfloat16, enabled=amp is not None):
        loss, metrics = fn(**{**inputs, "log_prob": logp}, loss_agg_mode="token-mean", config=_config())
    (grad,) = torch.autograd.grad(loss, logp)
    return loss.detach(), grad, metrics


@pytest.mark.parametrize("amp", [torch.bfloat16, torch.float16], ids=str)
def test_policy_loss_under_autocast_equals_float32(amp: torch.dtype) -> None:
    configure({"alpha_sdpo": 0.5, "beta_replay": 0.3})
    inputs, extras = _inputs(torch.float32)
    ref, g_ref, _m_ref = _run(inputs, extras, None)
    out, g, m = _run(inputs, extras, amp)
    assert m["composer/loss/sdpo"] > 0 and "composer/loss/replay" in m  # channels 2 and 3 computed
    assert out.dtype == g.dtype == torch.float32
    torch.testing.assert_close(out, ref, rtol=2e-6, atol=1e-12)
    torch.testing.assert_close(g, g_ref, rtol=2e-6, atol=1e-12)


def test_bf16_log_probs_under_autocast() -> None:
    """bf16 log-probs: autocast changes nothing (the same bf16 call without autocast, bitwise); the gradient
    comes back in bf16. (The channel-2 value then differs from the float32 one by bf16 input rounding.)"""
    configure({"alpha_sdpo": 0.5})
    inputs, extras = _inputs(torch.bfloat16)
    ref, g_ref, _ = _run(inputs, extras, None)
    out, g, m = _run(inputs, extras, torch.bfloat16)
    assert m["composer/loss/sdpo"] > 0
    assert g.dtype == torch.bfloat16
    assert torch.equal(out, ref) and torch.equal(g, g_ref)
