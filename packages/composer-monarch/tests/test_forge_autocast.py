"""ComposerLoss (TorchForge's ``loss(logits, **targets)``) under mixed precision, channel 2 on.

One call under CPU bf16 / fp16 autocast equals the same call in float32 with autocast off, value and logits
gradient, to float32 rounding: for float32 logits, and for bf16 logits (a bf16 model's output, which the
loss upcasts) whose gradient comes back in bf16. Forms: full-vocabulary JSD, top-k (tail on and off), TAID,
entropy-aware OPD and the sampled-token estimator.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from composer_monarch.forge_loss import ComposerLoss

R, P, S, V = 4, 3, 5, 300

FORMS: dict[str, dict[str, Any]] = {
    "full": {},
    "topk": {"sdpo_form": "topk", "sdpo_topk": 8},
    "topk_no_tail": {"sdpo_form": "topk", "sdpo_topk": 8, "sdpo_topk_tail": False},
    "taid": {"sdpo_wrapper": "taid", "taid_t": 0.6},
    "entropy_opd": {"sdpo_wrapper": "entropy_opd", "entropy_opd_threshold": 0.1},
    "sampled": {"sdpo_form": "sampled"},
}


def _targets(form: str) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(R, P + S, V, generator=g) * 3
    mask = torch.ones(R, S, dtype=torch.bool)
    mask[1, 3:] = False
    t = {
        "response": torch.randint(0, V, (R, S), generator=g),
        "ref_logprobs": -torch.rand(R, S, generator=g) - 1.0,
        "advantages": torch.randn(R, 1, generator=g),
        "padding_mask": mask,
        "old_logprobs": -torch.rand(R, S, generator=g) - 4.0,
    }
    if form == "sampled":
        t["teacher_logprobs"] = -torch.rand(R, S, generator=g) - 4.0
    else:
        t["teacher_logits"] = torch.randn(R, S, V, generator=g) * 3
    return logits, t


def _run(form: str, logits: torch.Tensor, t: dict[str, torch.Tensor], amp: torch.dtype | None):
    loss_fn = ComposerLoss(loss_type="grpo", kl_beta=0.1, alpha_sdpo=0.5, beta_replay=0.0, **FORMS[form])
    x = logits.detach().clone().requires_grad_()
    with torch.autocast("cpu", dtype=amp or torch.bfloat16, enabled=amp is not None):
        loss = loss_fn(x, **t)
    loss.backward()
    assert loss_fn.last_result.sdpo is not None and loss_fn.last_result.sdpo.item() != 0.0
    return loss.detach(), x.grad


@pytest.mark.parametrize("form", sorted(FORMS))
@pytest.mark.parametrize("amp", [torch.bfloat16, torch.float16], ids=str)
def test_forge_loss_under_autocast_equals_float32(form: str, amp: torch.dtype) -> None:
    logits, t = _targets(form)
    ref, g_ref = _run(form, logits, t, None)
    out, g = _run(form, logits, t, amp)
    assert out.dtype == g.dtype == torch.float32
    torch.testing.assert_close(out, ref, rtol=2e-6, atol=1e-12)
    torch.testing.assert_close(g, g_ref, rtol=2e-6, atol=1e-12)


@pytest.mark.parametrize("form", sorted(FORMS))
def test_forge_loss_bf16_logits_under_autocast(form: str) -> None:
    logits, t = _targets(form)
    low = logits.to(torch.bfloat16)
    ref, g_ref = _run(form, low.float(), t, None)
    out, g = _run(form, low, t, torch.bfloat16)
    assert out.dtype == torch.float32 and g.dtype == torch.bfloat16
    torch.testing.assert_close(out, ref, rtol=2e-6, atol=1e-12)
    torch.testing.assert_close(g.float(), g_ref.to(torch.bfloat16).float(), rtol=0.0, atol=0.0)
