"""Mixed precision: every distillation loss computes in float32 (or better) whatever the ambient autocast.

Under ``torch.autocast`` matmuls would otherwise run in bf16/fp16:
the chunked engine's row dot products and the fused LM head. The reference is the same loss computed in
float32 with autocast off. Float32 inputs must give that value and those gradients to float32 rounding; bf16 /
fp16 inputs (what a bf16 model produces) must give the float32 computation on the upcast inputs, with
gradients returned in the inputs' dtype.

Every test runs on the CPU (CPU autocast) and, where a CUDA device is present, on it under CUDA autocast: there
the reference is the same computation on the same device, and every value and gradient must live on it.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from composer_core import fused_linear_generalized_jsd, generalized_jsd, topk_distill
from composer_core.loss.wrappers import entropy_opd_loss, taid_loss
from torch import Tensor

N, V, H = 6, 2000, 16
LOW = [torch.bfloat16, torch.float16]
_NO_CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
DEVICES = [pytest.param("cpu"), pytest.param("cuda", marks=_NO_CUDA)]


def _logits(device: str = "cpu") -> tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(0)
    return (torch.randn(N, V, generator=g) * 3).to(device), (torch.randn(N, V, generator=g) * 3).to(device)


LOGIT_LOSSES: dict[str, Callable[[Tensor, Tensor], Tensor]] = {
    "jsd_fkl": lambda s, t: generalized_jsd(s, t, beta=0.0, chunk_size=4),
    "jsd_half": lambda s, t: generalized_jsd(s, t, beta=0.5, chunk_size=4, temperature=1.5),
    "jsd_rkl": lambda s, t: generalized_jsd(s, t, beta=1.0, chunk_size=4),
    "jsd_none": lambda s, t: (
        generalized_jsd(s, t, chunk_size=4, reduction="none") * torch.arange(N, device=s.device)
    ).sum(),
    "taid": lambda s, t: taid_loss(s, t, 0.6, chunk_size=4),
    "eopd_full": lambda s, t: entropy_opd_loss(s, t, threshold=0.1, chunk_size=4),
    "eopd_topk": lambda s, t: entropy_opd_loss(s, t, threshold=0.1, topk=7, beta=1.0, chunk_size=4),
    "topk_tail": lambda s, t: topk_distill(s, t, k=5),
    "topk_no_tail": lambda s, t: topk_distill(s, t, k=5, add_tail_bucket=False, beta=0.3),
}


def _value_and_grad(
    fn: Callable[[Tensor, Tensor], Tensor], s: Tensor, t: Tensor, autocast: torch.dtype | None
) -> tuple[Tensor, Tensor]:
    x = s.detach().clone().requires_grad_()
    with torch.autocast(s.device.type, dtype=autocast or torch.bfloat16, enabled=autocast is not None):
        value = fn(x, t)
    value.backward()
    assert x.grad is not None
    assert value.device == x.grad.device == s.device
    return value.detach(), x.grad


def _close32(actual: Tensor, expected: Tensor) -> None:
    """Equal to float32 rounding (no absolute slack that could hide a bf16 matmul)."""
    assert actual.dtype == expected.dtype
    torch.testing.assert_close(actual, expected, rtol=2e-6, atol=1e-12)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", sorted(LOGIT_LOSSES))
@pytest.mark.parametrize("amp", LOW, ids=str)
def test_float32_inputs_under_autocast_equal_float32(name: str, amp: torch.dtype, device: str) -> None:
    fn = LOGIT_LOSSES[name]
    s, t = _logits(device)
    v_ref, g_ref = _value_and_grad(fn, s, t, None)
    v, g = _value_and_grad(fn, s, t, amp)
    assert v.dtype == torch.float32
    _close32(v, v_ref)
    _close32(g, g_ref)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", sorted(LOGIT_LOSSES))
@pytest.mark.parametrize("amp", LOW, ids=str)
def test_low_precision_inputs_compute_in_float32_and_return_grads_in_their_dtype(
    name: str, amp: torch.dtype, device: str
) -> None:
    fn = LOGIT_LOSSES[name]
    s32, t32 = _logits(device)
    s, t = s32.to(amp), t32.to(amp)  # logits as a bf16/fp16 model produces them
    v_ref, g_ref = _value_and_grad(fn, s.float(), t.float(), None)
    v, g = _value_and_grad(fn, s, t, amp)
    assert v.dtype == torch.float32  # the loss itself is a float32 number
    _close32(v, v_ref)
    assert g.dtype == amp
    # The [N, V] gradient is kept in the input dtype (memory); a non-unit upstream gradient (here the per-row
    # weights 0..N-1 of reduction="none") rescales it in backward, a second rounding: one ulp of ``amp``
    # (for fp16 subnormals, one subnormal step times the weight).
    ulp = torch.finfo(amp).eps if name == "jsd_none" else 0.0
    sub = ulp * torch.finfo(amp).tiny * N
    torch.testing.assert_close(g.float(), g_ref.to(amp).float(), rtol=ulp, atol=sub)


def _fused_inputs(dtype: torch.dtype, device: str) -> tuple[Tensor, ...]:
    g = torch.Generator().manual_seed(1)
    hs, ht = torch.randn(N, H, generator=g), torch.randn(N, H, generator=g)
    w, b = torch.randn(V, H, generator=g) * 0.5, torch.randn(V, generator=g)
    return tuple(x.to(device, dtype) for x in (hs, ht, w, b))


def _fused(hs: Tensor, ht: Tensor, w: Tensor, b: Tensor, amp: torch.dtype | None) -> tuple[Tensor, ...]:
    leaves = [x.detach().clone().requires_grad_() for x in (hs, w, b)]
    with torch.autocast(hs.device.type, dtype=amp or torch.bfloat16, enabled=amp is not None):
        value = fused_linear_generalized_jsd(
            leaves[0], leaves[1], ht, lm_head_bias=leaves[2], beta=0.5, chunk_size=4
        )
    value.backward()
    assert all(x.grad is not None and x.grad.device == hs.device for x in leaves)
    assert value.device == hs.device
    return (value.detach(), *(x.grad for x in leaves))  # type: ignore[misc]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("amp", LOW, ids=str)
def test_fused_linear_jsd_float32_inputs_under_autocast(amp: torch.dtype, device: str) -> None:
    """Today's failure: ``grad_w.addmm_`` raised ``mat1 and mat2 must have the same dtype`` under autocast."""
    inputs = _fused_inputs(torch.float32, device)
    ref = _fused(*inputs, None)
    out = _fused(*inputs, amp)
    for a, e in zip(out, ref):
        _close32(a, e)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("amp", LOW, ids=str)
def test_fused_linear_jsd_low_precision_inputs(amp: torch.dtype, device: str) -> None:
    inputs = _fused_inputs(amp, device)
    ref = _fused(*(x.float() for x in inputs), None)
    value, *grads = _fused(*inputs, amp)
    assert value.dtype == torch.float32
    _close32(value, ref[0])
    for g, e in zip(grads, ref[1:]):
        assert g.dtype == amp
        torch.testing.assert_close(g.float(), e.to(amp).float(), rtol=0.0, atol=0.0)


def test_float64_inputs_stay_float64_under_autocast() -> None:
    """ "float32 or better": float64 inputs are not cast down by the autocast guard."""
    s, t = (x.double() for x in _logits())
    v_ref, g_ref = _value_and_grad(LOGIT_LOSSES["jsd_half"], s, t, None)
    v, g = _value_and_grad(LOGIT_LOSSES["jsd_half"], s, t, torch.bfloat16)
    assert v.dtype == g.dtype == torch.float64
    torch.testing.assert_close(v, v_ref, rtol=1e-14, atol=0.0)
    torch.testing.assert_close(g, g_ref, rtol=1e-14, atol=0.0)


# ------------------------------------------------------------------ compose_loss, channel 2 on, each form

_FORMS: dict[str, dict[str, object]] = {
    "full": {"sdpo_form": "full"},
    "fused": {"sdpo_form": "full"},
    "topk": {"sdpo_form": "topk", "sdpo_topk": 4},
    "topk_no_tail": {"sdpo_form": "topk", "sdpo_topk": 4, "sdpo_topk_tail": False},
    "sampled": {"sdpo_form": "sampled"},
    "taid": {"sdpo_wrapper": "taid", "taid_t": 0.7},
    "taid_fused": {"sdpo_wrapper": "taid", "taid_t": 0.7},
    "entropy_opd": {"sdpo_wrapper": "entropy_opd", "entropy_opd_threshold": 0.1},
    "entropy_opd_fused": {"sdpo_wrapper": "entropy_opd", "entropy_opd_threshold": 0.1},
}


def _compose_batch(form: str, dtype: torch.dtype, device: str) -> dict[str, Tensor]:
    g = torch.Generator().manual_seed(3)
    b, t, v, h = 3, 5, 500, 8
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    mask = torch.ones(b, t)
    mask[1, 3:] = 0
    fields = {
        "logprobs": (r(b, t) - 2).to(dtype),
        "old_logprobs": r(b, t) - 2,
        "advantages": r(b),
        "completion_mask": mask,
    }
    if form == "sampled":
        fields["teacher_logprobs"] = r(b, t) - 2
    elif form.endswith("fused") or form == "fused":
        fields["student_hidden"] = r(b, t, h).to(dtype)
        fields["teacher_hidden"] = r(b, t, h).to(dtype)
        fields["lm_head_weight"] = (r(v, h) * 0.5).to(dtype)
    else:
        fields["student_logits"] = (r(b, t, v) * 3).to(dtype)
        fields["teacher_logits"] = (r(b, t, v) * 3).to(dtype)
    return {k: x.to(device) for k, x in fields.items()}


_LEAVES = ("logprobs", "student_logits", "student_hidden", "lm_head_weight")


def _compose(fields: dict[str, Tensor], form: str, amp: torch.dtype | None) -> tuple[Tensor, list[Tensor]]:
    from composer_core import ComposerBatch, compose_loss

    inputs = {k: (v.detach().clone().requires_grad_() if k in _LEAVES else v) for k, v in fields.items()}
    device = fields["logprobs"].device
    with torch.autocast(device.type, dtype=amp or torch.bfloat16, enabled=amp is not None):
        out = compose_loss(ComposerBatch(**inputs), alpha_sdpo=0.5, **_FORMS[form])  # type: ignore[arg-type]
    assert out.sdpo is not None
    out.total.backward()
    grads = [inputs[k].grad for k in _LEAVES if k in inputs]
    assert out.total.device == device and all(g is not None and g.device == device for g in grads)
    assert all(m.device == device for m in out.metrics.tensors().values() if isinstance(m, Tensor))
    return out.total.detach(), grads  # type: ignore[return-value]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("form", sorted(_FORMS))
@pytest.mark.parametrize("amp", LOW, ids=str)
def test_compose_loss_under_autocast_equals_float32(form: str, amp: torch.dtype, device: str) -> None:
    fields = _compose_batch(form, torch.float32, device)
    total_ref, grads_ref = _compose(fields, form, None)
    total, grads = _compose(fields, form, amp)
    _close32(total, total_ref)
    for g, e in zip(grads, grads_ref):
        _close32(g, e)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("form", sorted(_FORMS))
def test_compose_loss_bf16_inputs_under_autocast(form: str, device: str) -> None:
    """A bf16 model's tensors: the loss is the float32 computation on them, gradients come back in bf16."""
    fields = _compose_batch(form, torch.bfloat16, device)
    upcast = {k: (v.float() if v.is_floating_point() else v) for k, v in fields.items()}
    total_ref, grads_ref = _compose(upcast, form, None)
    total, grads = _compose(fields, form, torch.bfloat16)
    torch.testing.assert_close(total.float(), total_ref, rtol=2e-6, atol=1e-12)
    for g, e in zip(grads, grads_ref):
        assert g.dtype == torch.bfloat16
        # one bf16 rounding of the float32 gradient, plus at most one more where α rescales a stored gradient
        torch.testing.assert_close(g.float(), e.to(torch.bfloat16).float(), rtol=2**-7, atol=1e-30)


# ------------------------------------------------------------------ one rounding, whatever carries the count
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("path", ["host", "accelerator"])
@pytest.mark.parametrize("normaliser", ["count", "tensor"])
@pytest.mark.parametrize("amp", LOW, ids=str)
def test_tensor_normaliser_and_masked_mean_round_the_gradient_once(
    amp: torch.dtype, normaliser: str, path: str, device: str, force_accelerator: Callable[[], None]
) -> None:
    """A bf16 gradient is the float32 one rounded once: ``1 / count`` (a tensor normaliser, or the mask's count
    kept on the device on an accelerator) is folded in before the store, not applied to the stored bf16."""

    if path == "accelerator":
        force_accelerator()
    s32, t32 = _logits(device)
    mask = torch.ones(N, dtype=torch.bool, device=device)
    mask[1] = mask[4] = False
    norm = torch.tensor(3.0, device=device) if normaliser == "tensor" else None
    fn = lambda s, t: generalized_jsd(s, t, beta=0.5, chunk_size=4, mask=mask, normalizer=norm)  # noqa: E731
    v_ref, g_ref = _value_and_grad(fn, s32.to(amp).float(), t32.to(amp).float(), None)
    v, g = _value_and_grad(fn, s32.to(amp), t32.to(amp), amp)
    _close32(v, v_ref)
    torch.testing.assert_close(g.float(), g_ref.to(amp).float(), rtol=0.0, atol=0.0)


@pytest.mark.parametrize("device", DEVICES)
def test_a_bf16_batch_gives_the_float32_loss_on_every_channel(device: str) -> None:
    """Policy, sampled-token SDPO and replay on an all-bf16 batch: the float32 computation on the upcast
    values, with or without autocast (CUDA autocast runs exp/log in float32, CPU autocast does not; computing
    in bf16 gave two different losses for one batch, and a policy loss rounded to bf16)."""
    from composer_core import ComposerBatch, compose_loss

    g = torch.Generator().manual_seed(5)
    r = lambda *s: torch.randn(*s, generator=g).to(device, torch.bfloat16)  # noqa: E731
    lengths = torch.tensor([3, 4, 9], device=device)
    fields = {
        "logprobs": r(4, 6) - 2, "advantages": r(4), "old_logprobs": r(4, 6) - 2, "ref_logprobs": r(4, 6) - 2,
        "teacher_logprobs": r(4, 6) - 2, "chosen_logps": r(3) * 20, "rejected_logps": r(3) * 20,
        "ref_chosen_logps": r(3) * 20, "ref_rejected_logps": r(3) * 20,
    }  # fmt: skip
    mask = torch.ones(4, 6, device=device)
    opts = {"alpha_sdpo": 0.5, "kl_beta": 0.04, "beta_replay": 0.3}
    results = []
    for dtype, amp in ((torch.float32, False), (torch.bfloat16, False), (torch.bfloat16, True)):
        leaves = {
            k: v.to(dtype).clone().requires_grad_(k in ("logprobs", "chosen_logps"))
            for k, v in fields.items()
        }
        batch = ComposerBatch(
            completion_mask=mask, chosen_lengths=lengths, rejected_lengths=lengths + 1, **leaves
        )
        with torch.autocast(device, dtype=torch.bfloat16, enabled=amp):
            out = compose_loss(batch, **opts)  # type: ignore[arg-type]
        out.total.backward()
        results.append((out, leaves["logprobs"].grad, leaves["chosen_logps"].grad))
    (ref, g_ref, c_ref), *low = results
    for out, g_lp, g_c in low:
        for name in ("policy", "sdpo", "replay", "total"):
            assert getattr(out, name).dtype == torch.float32
            _close32(getattr(out, name).detach(), getattr(ref, name).detach())
        assert g_lp.dtype == g_c.dtype == torch.bfloat16
        torch.testing.assert_close(g_lp.float(), g_ref.to(torch.bfloat16).float(), rtol=2**-8, atol=0.0)
        torch.testing.assert_close(g_c.float(), c_ref.to(torch.bfloat16).float(), rtol=2**-8, atol=0.0)
