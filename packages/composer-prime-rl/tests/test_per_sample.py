"""Per-sample semantics: one call = one sample, empty masks, input validation."""

from __future__ import annotations

import math

import pytest
import torch
from composer_prime_rl import LossInputs, composer_loss

CONFIGS = [
    {},
    {"policy_loss": "clipped_surrogate"},
    {"alpha_sdpo": 0.5},
    {"policy_loss": "clipped_surrogate", "alpha_sdpo": 2.0, "sdpo_token_clip": None},
]


@pytest.mark.parametrize("kwargs", CONFIGS)
def test_empty_mask_gives_an_attached_exact_zero_and_zero_metrics(make_inputs, kwargs) -> None:
    """PRIME-RL calls the rl loss for every sample when no rl weight stream exists, also for a
    sample with no rl token; its own default_loss_fn returns 0 there. composer does the same
    (no ValueError, unlike composer_core's rule for an empty *batch*): emptiness of the whole
    batch is PRIME-RL's business (its global count), not one sample's."""
    full = make_inputs(p_train=[0.9, 0.5], p_inf=[0.6, 0.6], p_ref=[0.5, 0.2], adv=[1.0, -1.0])
    empty = make_inputs(
        lp_train=[-math.inf, math.nan],  # garbage outside the mask must not leak
        lp_inf=[math.nan, 0.0],
        lp_ref=None,  # not needed: nothing to distil
        adv=[math.inf, 1.0],
        mask=[False, False],
    )
    out = composer_loss(empty, **kwargs)
    assert out.loss.item() == 0.0 and out.loss.dim() == 0
    assert out.loss.requires_grad
    out.loss.backward()
    assert torch.equal(empty.trainer_logprobs.grad, torch.zeros(2, dtype=torch.float64))
    assert set(out.metrics) == set(composer_loss(full, **kwargs).metrics)
    assert all(v.item() == 0.0 for v in out.metrics.values())


@pytest.mark.parametrize("kwargs", CONFIGS)
def test_tokens_outside_the_mask_do_not_count_even_if_garbage(make_inputs, kwargs) -> None:
    one = make_inputs(p_train=[0.5], p_inf=[0.6], p_ref=[0.3], adv=[1.0])
    padded = make_inputs(
        lp_train=[-math.inf, math.log(0.5), math.nan],
        lp_inf=[0.0, math.log(0.6), -math.inf],
        lp_ref=[math.nan, math.log(0.3), 0.0],
        adv=[5.0, 1.0, math.nan],
        weights=[math.nan, 1.0, 7.0],
        mask=[False, True, False],
    )
    a, b = composer_loss(one, **kwargs), composer_loss(padded, **kwargs)
    assert b.loss.item() == pytest.approx(a.loss.item(), rel=1e-15)
    a.loss.backward()
    b.loss.backward()
    grad = padded.trainer_logprobs.grad
    assert grad[0] == 0 and grad[2] == 0
    assert grad[1].item() == pytest.approx(one.trainer_logprobs.grad[0].item(), rel=1e-15)
    for key, value in a.metrics.items():
        assert b.metrics[key].item() == pytest.approx(value.item(), rel=1e-6), key


def test_float32_inputs_keep_their_dtype(make_inputs) -> None:
    inputs = make_inputs(
        p_train=[0.5, 0.9], p_inf=[0.6, 0.6], p_ref=[0.3, 0.8], adv=[1.0, -1.0], dtype=torch.float32
    )
    out = composer_loss(inputs, alpha_sdpo=1.0)
    assert out.loss.dtype == torch.float32
    reference = composer_loss(
        make_inputs(p_train=[0.5, 0.9], p_inf=[0.6, 0.6], p_ref=[0.3, 0.8], adv=[1.0, -1.0]), alpha_sdpo=1.0
    )
    assert out.loss.item() == pytest.approx(reference.loss.item(), rel=1e-6)


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
@pytest.mark.parametrize("ref", ["real", "zero-filled", "absent"])
def test_every_metric_is_a_float32_scalar_whatever_the_input_dtype(make_inputs, dtype, ref) -> None:
    """PRIME-RL stacks each key over the samples of a step: one dtype for every key and call (the skip flag
    came out in the inputs' dtype before, the means in float32)."""
    args = {"p_train": [0.5, 0.9], "p_inf": [0.6, 0.6], "adv": [1.0, -1.0], "dtype": dtype}
    inputs = make_inputs(**args, **({} if ref == "absent" else {"p_ref": [0.3, 0.8]}))
    if ref == "zero-filled":
        inputs = LossInputs(
            inputs.trainer_logprobs, inputs.inference_logprobs, torch.zeros(2, dtype=dtype), inputs.advantages,
            inputs.loss_mask,
        )  # fmt: skip
    out = composer_loss(inputs, alpha_sdpo=1.0, sdpo_missing="skip")
    assert {(k, v.dtype, v.dim()) for k, v in out.metrics.items()} == {
        (k, torch.float32, 0) for k in out.metrics
    }
    assert out.metrics["composer/sdpo/skipped"].item() == (0.0 if ref == "real" else 1.0)


def test_float_mask_of_zeros_and_ones_is_accepted(make_inputs) -> None:
    a = make_inputs(p_train=[0.5, 0.9], p_inf=[0.6, 0.6], adv=[1.0, -1.0], mask=[True, False])
    b = LossInputs(
        trainer_logprobs=a.trainer_logprobs,
        inference_logprobs=a.inference_logprobs,
        ref_logprobs=None,
        advantages=a.advantages,
        loss_mask=torch.tensor([1.0, 0.0]),
    )
    assert composer_loss(b).loss.item() == composer_loss(a).loss.item()


def _replace(inputs, **fields):
    values = {
        "trainer_logprobs": inputs.trainer_logprobs,
        "inference_logprobs": inputs.inference_logprobs,
        "ref_logprobs": inputs.ref_logprobs,
        "advantages": inputs.advantages,
        "loss_mask": inputs.loss_mask,
        "loss_weights": inputs.loss_weights,
    }
    values.update(fields)
    return LossInputs(**values)


@pytest.mark.parametrize(
    ("fields", "kwargs", "message"),
    [
        ({"trainer_logprobs": torch.zeros(1, 3)}, {}, "trainer_logprobs must be 1-D"),
        ({"advantages": torch.zeros(2)}, {}, "advantages has 2 tokens but trainer_logprobs has 3"),
        ({"loss_mask": torch.ones(4, dtype=torch.bool)}, {}, "loss_mask has 4 tokens"),
        ({"loss_weights": torch.ones(2, dtype=torch.float64)}, {}, "loss_weights has 2 tokens"),
        (
            {"ref_logprobs": torch.zeros(5, dtype=torch.float64)},
            {"alpha_sdpo": 1.0},
            "ref_logprobs has 5 tokens",
        ),
        ({"inference_logprobs": [0.0, 0.0, 0.0]}, {}, "inference_logprobs must be a torch.Tensor"),
        ({"advantages": torch.ones(3, dtype=torch.long)}, {}, "advantages must be a floating-point tensor"),
        ({"loss_mask": torch.tensor([0, 1, 2])}, {}, "loss_mask must be boolean"),
        ({"trainer_logprobs": torch.tensor([0.0, math.nan, 0.0])}, {}, "trainer_logprobs has NaN or inf"),
        (
            {"inference_logprobs": torch.tensor([-math.inf, 0.0, 0.0])},
            {},
            "inference_logprobs has NaN or inf",
        ),
        ({"advantages": torch.tensor([0.0, 0.0, math.inf])}, {}, "advantages has NaN or inf"),
        ({"loss_weights": torch.tensor([1.0, math.nan, 1.0])}, {}, "loss_weights has NaN or inf"),
        (
            {"ref_logprobs": torch.tensor([-1.0, math.nan, -1.0])},
            {"alpha_sdpo": 1.0},
            "ref_logprobs has NaN or inf",
        ),
        (  # every value finite, their masked sum is not: refused, never a silent inf loss
            {"advantages": torch.tensor([1e308, 1e308, 0.0], dtype=torch.float64)},
            {},
            "finite but so large that their sum over loss_mask overflows torch.float64",
        ),
    ],
)
def test_bad_inputs_raise_naming_the_field(make_inputs, fields, kwargs, message) -> None:
    base = make_inputs(
        p_train=[0.5, 0.6, 0.7], p_inf=[0.5, 0.5, 0.5], p_ref=[0.4, 0.4, 0.4], adv=[1.0, -1.0, 0.5]
    )
    with pytest.raises(ValueError, match=message):
        composer_loss(_replace(base, **fields), **kwargs)


@pytest.mark.parametrize("kwargs", CONFIGS)
@pytest.mark.parametrize("seed", range(3))
def test_loss_is_additive_over_tokens_so_packing_cannot_change_it(make_inputs, kwargs, seed) -> None:
    """Every term is per token, so cutting one sample into pieces (PRIME-RL packs and may
    truncate sub-sequences) leaves the summed loss and its gradient unchanged."""
    g = torch.Generator().manual_seed(seed)
    n = 11
    p_inf = (torch.rand(n, generator=g, dtype=torch.float64) * 0.8 + 0.1).tolist()
    p_train = [
        min(max(p + d, 0.05), 0.95) for p, d in zip(p_inf, (torch.rand(n, generator=g) - 0.5).tolist())
    ]
    p_ref = (torch.rand(n, generator=g, dtype=torch.float64) * 0.8 + 0.1).tolist()
    adv = torch.randn(n, generator=g, dtype=torch.float64).tolist()
    mask = (torch.rand(n, generator=g) > 0.2).tolist()
    mask[0] = True
    whole = make_inputs(p_train=p_train, p_inf=p_inf, p_ref=p_ref, adv=adv, mask=mask)
    out = composer_loss(whole, **kwargs)
    out.loss.backward()
    cuts = sorted(torch.randperm(n - 1, generator=g)[:2].add(1).tolist())
    total, grads = 0.0, []
    for a, b in zip([0, *cuts], [*cuts, n]):
        piece = make_inputs(
            p_train=p_train[a:b], p_inf=p_inf[a:b], p_ref=p_ref[a:b], adv=adv[a:b], mask=mask[a:b]
        )
        if "alpha_sdpo" in kwargs and not any(mask[a:b]):
            piece = _replace(piece, ref_logprobs=None)  # an rl-empty piece needs no teacher
        res = composer_loss(piece, **kwargs)
        res.loss.backward()
        total += res.loss.item()
        grads.append(piece.trainer_logprobs.grad)
    assert total == pytest.approx(out.loss.item(), rel=1e-12, abs=1e-14)
    torch.testing.assert_close(torch.cat(grads), whole.trainer_logprobs.grad, rtol=1e-12, atol=1e-14)


# ------------------------------------------------------------------ host reads per call (issue 19)
@pytest.mark.parametrize("kwargs", CONFIGS)
@pytest.mark.parametrize("mask_kind", ["bool", "float01"])
def test_one_call_reads_the_host_at_most_once(
    make_inputs, kwargs, mask_kind, monkeypatch, host_reads
) -> None:
    """Every value check of a sample is fused into one condition read once (PRIME-RL calls the loss once per
    packed sample: a sync per check would stall the device that often). Zero-filled ``ref_logprobs`` (the
    packer's fill) and empty masks are handled without a branch on tensor values."""
    inputs = make_inputs(
        p_train=[0.9, 0.5, 0.3], p_inf=[0.6, 0.6, 0.2], p_ref=[0.5, 0.2, 0.4], adv=[1.0, -1.0, 0.5]
    )
    if mask_kind == "float01":
        inputs = LossInputs(
            inputs.trainer_logprobs, inputs.inference_logprobs, inputs.ref_logprobs, inputs.advantages,
            torch.tensor([1.0, 0.0, 1.0]),
        )  # fmt: skip
    zero_filled = LossInputs(
        inputs.trainer_logprobs, inputs.inference_logprobs, torch.zeros(3, dtype=torch.float64),
        inputs.advantages, inputs.loss_mask,
    )  # fmt: skip
    calls = host_reads()
    for sample in (inputs, zero_filled):
        calls.clear()
        out = composer_loss(sample, **kwargs)
        assert len(calls) <= 1, calls
    monkeypatch.undo()
    out.loss.backward()
    if kwargs.get("alpha_sdpo"):
        assert out.metrics["composer/sdpo/skipped"].item() == 1.0  # the zero-filled sample skipped channel 2
