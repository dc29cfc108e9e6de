"""Channel 2: sampled-token self-distillation with ``ref_logprobs`` as the hinted teacher.

Check value (loss-math.md §8): p_S = 0.5, p_T = 0.25 on the sampled token gives the
gradient coefficient +ln 2 = 0.69315 on ℓ_S (reverse KL pushes ℓ_S down towards the
teacher), times α and the detached importance weight min(π_train/π_inf, sdpo_token_clip).
The policy term is switched off in these cases (A = 0, kl_tau = 0) to isolate channel 2.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from composer_core import ADAPTER_PREFIX, METRIC_KEYS
from composer_prime_rl import composer_loss

LN2 = math.log(2.0)
OFF = {"adv_tau": 1.0, "kl_tau": 0.0}  # with A = 0 the DPPO term is exactly zero


@pytest.mark.parametrize(
    ("p_inf", "kwargs", "coefficient"),
    [
        (0.5, {"alpha_sdpo": 1.0}, LN2),  # on-policy: importance weight 1
        (0.5, {"alpha_sdpo": 0.5}, 0.5 * LN2),
        (0.5 / 3, {"alpha_sdpo": 1.0}, 2 * LN2),  # ρ = 3 capped at the default clip 2
        (0.5 / 3, {"alpha_sdpo": 1.0, "sdpo_token_clip": 5.0}, 3 * LN2),  # ρ = 3 below a cap of 5
        (0.5 / 3, {"alpha_sdpo": 1.0, "sdpo_token_clip": None}, LN2),  # no importance weight
        (0.5 / 3, {"alpha_sdpo": 1.0, "sdpo_token_clip": False}, LN2),  # the same, spelled in TOML
        (0.5 / 3, {"alpha_sdpo": 1.0, "sdpo_token_clip": 2.5}, 2.5 * LN2),
        (1.0, {"alpha_sdpo": 1.0}, 0.5 * LN2),  # ρ = 0.5 below the clip
    ],
)
def test_sampled_token_gradient_check_value(make_inputs, p_inf, kwargs, coefficient) -> None:
    inputs = make_inputs(p_train=[0.5], p_inf=[p_inf], p_ref=[0.25], adv=[0.0])
    out = composer_loss(inputs, **OFF, **kwargs)
    out.loss.backward()
    assert inputs.trainer_logprobs.grad.item() == pytest.approx(coefficient, rel=1e-12)
    assert out.metrics["composer/sdpo/reverse_kl_k1"].item() == pytest.approx(LN2, rel=1e-6)
    assert out.metrics["composer/sdpo/skipped"].item() == 0.0


def test_student_equal_to_teacher_gives_zero_gradient(make_inputs) -> None:
    inputs = make_inputs(p_train=[0.3, 0.7], p_inf=[0.3, 0.7], p_ref=[0.3, 0.7], adv=[0.0, 0.0])
    out = composer_loss(inputs, alpha_sdpo=1.0, **OFF)
    out.loss.backward()
    assert torch.count_nonzero(inputs.trainer_logprobs.grad) == 0
    assert out.loss.item() == 0.0


def test_channels_add_per_token_with_weights(make_inputs) -> None:
    # DPPO kept token (A = −1, ρ = 1.5) + α × SDPO, both scaled by the token weight.
    inputs = make_inputs(
        p_train=[0.9, 0.5], p_inf=[0.6, 0.5], p_ref=[0.9, 0.25], adv=[-1.0, 0.0], weights=[2.0, 3.0]
    )
    out = composer_loss(inputs, alpha_sdpo=0.5, kl_tau=0.0)
    out.loss.backward()
    # token 0: policy grad −A·ρ = 1.5, sdpo grad 0 (student = teacher); token 1: 0.5·ln2
    expected = torch.tensor([2.0 * 1.5, 3.0 * 0.5 * LN2], dtype=torch.float64)
    torch.testing.assert_close(inputs.trainer_logprobs.grad, expected, rtol=1e-12, atol=1e-15)


def test_missing_ref_logprobs_raises_by_default(make_inputs) -> None:
    with pytest.raises(ValueError, match=r"no ref_logprobs.*sdpo_missing"):
        composer_loss(make_inputs(p_train=[0.5], p_inf=[0.5], adv=[1.0]), alpha_sdpo=1.0)


def test_packer_zero_fill_is_skipped_not_an_error(make_inputs) -> None:
    # PRIME-RL fills ref_logprobs of a sample without them with 0.0 (the whole sample, prompt
    # included) when a neighbour in the micro-batch has some: skipped on channel 2 even with
    # the default sdpo_missing = "error" (the run does ship hints; this source has none).
    args = {"p_train": [0.5, 0.4, 0.3], "p_inf": [0.5, 0.4, 0.3], "adv": [1.0, 1.0, -1.0]}
    mask = [False, True, True]  # the first token is prompt
    filled = composer_loss(make_inputs(**args, lp_ref=[0.0, 0.0, 0.0], mask=mask), alpha_sdpo=1.0)
    assert filled.metrics["composer/sdpo/skipped"].item() == 1.0
    assert filled.loss.item() == composer_loss(make_inputs(**args, mask=mask)).loss.item()
    # a real teacher that is certain (log-prob 0) on every rl token but not on the prompt is kept
    certain = composer_loss(make_inputs(**args, lp_ref=[-2.0, 0.0, 0.0], mask=mask), alpha_sdpo=1.0)
    assert certain.metrics["composer/sdpo/skipped"].item() == 0.0
    assert certain.metrics["composer/sdpo/reverse_kl_k1"].item() == pytest.approx(
        math.log(0.4 * 0.3) / 2, rel=1e-6
    )


def test_skip_trains_the_policy_only_and_reports_it(make_inputs) -> None:
    args = {"p_train": [0.9, 0.5], "p_inf": [0.6, 0.6], "adv": [-1.0, 1.0]}
    skipped = composer_loss(make_inputs(**args), alpha_sdpo=1.0, sdpo_missing="skip")
    policy_only = composer_loss(make_inputs(**args))
    assert skipped.loss.item() == policy_only.loss.item()
    assert skipped.metrics["composer/sdpo/skipped"].item() == 1.0
    assert skipped.metrics["composer/loss/sdpo"].item() == 0.0
    # the metric keys stay those of a run with channel 2 on
    with_ref = composer_loss(make_inputs(**args, p_ref=[0.5, 0.5]), alpha_sdpo=1.0, sdpo_missing="skip")
    assert set(with_ref.metrics) == set(skipped.metrics)
    assert with_ref.metrics["composer/sdpo/skipped"].item() == 0.0


def test_alpha_zero_ignores_ref_logprobs(make_inputs) -> None:
    args = {"p_train": [0.9, 0.5], "p_inf": [0.6, 0.6], "adv": [-1.0, 1.0]}
    with_ref = composer_loss(make_inputs(**args, p_ref=[0.01, 0.99]))
    assert with_ref.loss.item() == composer_loss(make_inputs(**args)).loss.item()
    assert "composer/loss/sdpo" not in with_ref.metrics


@dataclasses.dataclass
class _OldLossInputs:
    """PRIME-RL's LossInputs before commit 0be5ac45: teacher_logprobs, no loss_weights."""

    trainer_logprobs: torch.Tensor
    inference_logprobs: torch.Tensor
    teacher_logprobs: torch.Tensor | None
    advantages: torch.Tensor
    loss_mask: torch.Tensor


def test_former_field_name_teacher_logprobs(make_inputs) -> None:
    new = make_inputs(p_train=[0.5, 0.7], p_inf=[0.5, 0.6], p_ref=[0.25, 0.9], adv=[0.5, -0.5])
    old_lp = new.trainer_logprobs.detach().clone().requires_grad_(True)
    old = _OldLossInputs(old_lp, new.inference_logprobs, new.ref_logprobs, new.advantages, new.loss_mask)
    a = composer_loss(new, alpha_sdpo=0.7)
    b = composer_loss(old, alpha_sdpo=0.7)
    assert a.loss.item() == b.loss.item()
    a.loss.backward()
    b.loss.backward()
    torch.testing.assert_close(new.trainer_logprobs.grad, old_lp.grad, rtol=0, atol=0)


def test_both_names_with_different_tensors_is_ambiguous(make_inputs) -> None:
    inputs = make_inputs(p_train=[0.5], p_inf=[0.5], p_ref=[0.25], adv=[0.0])

    @dataclasses.dataclass
    class Both:
        trainer_logprobs: torch.Tensor
        inference_logprobs: torch.Tensor
        ref_logprobs: torch.Tensor
        teacher_logprobs: torch.Tensor
        advantages: torch.Tensor
        loss_mask: torch.Tensor

    both = Both(
        inputs.trainer_logprobs,
        inputs.inference_logprobs,
        inputs.ref_logprobs,
        inputs.ref_logprobs.clone(),
        inputs.advantages,
        inputs.loss_mask,
    )
    with pytest.raises(ValueError, match="both ref_logprobs and teacher_logprobs"):
        composer_loss(both, alpha_sdpo=1.0)


@pytest.mark.parametrize("form", ["full", "topk", "fused"])
def test_full_vocabulary_forms_raise_not_zero(make_inputs, form) -> None:
    with pytest.raises(ValueError, match="only the log-prob of each sampled token"):
        composer_loss(
            make_inputs(p_train=[0.5], p_inf=[0.5], p_ref=[0.25], adv=[0.0]), alpha_sdpo=1.0, sdpo_form=form
        )


def test_auto_form_is_the_sampled_form(make_inputs) -> None:
    # compose_loss's "auto" picks the form whose inputs exist; in PRIME-RL that is "sampled"
    args = {"p_train": [0.5, 0.7], "p_inf": [0.5, 0.6], "p_ref": [0.25, 0.9], "adv": [0.5, -0.5]}
    auto = composer_loss(make_inputs(**args), alpha_sdpo=1.0, sdpo_form="auto")
    sampled = composer_loss(make_inputs(**args), alpha_sdpo=1.0, sdpo_form="sampled")
    assert auto.loss.item() == sampled.loss.item()
    with pytest.raises(ValueError, match=r"`sdpo_form`='sampled_token' .* expected one of 'sampled', 'auto'"):
        composer_loss(make_inputs(**args), alpha_sdpo=1.0, sdpo_form="sampled_token")


@pytest.mark.parametrize("policy_loss", ["clipped_surrogate", "dppo"])
def test_metric_keys_are_composer_core_keys_under_the_prefix(make_inputs, policy_loss) -> None:
    """composer-core's keys under ``composer/`` plus the adapter's own ``sdpo/reverse_kl_k1``;
    PRIME-RL's own metric names (``mismatch_kl``, ``is_masked``, ...) stay unprefixed."""
    inputs = make_inputs(p_train=[0.5, 0.4], p_inf=[0.5, 0.3], p_ref=[0.25, 0.5], adv=[1.0, -1.0])
    out = composer_loss(inputs, alpha_sdpo=1.0, policy_loss=policy_loss)
    ours = {k.removeprefix(ADAPTER_PREFIX) for k in out.metrics if k.startswith(ADAPTER_PREFIX)}
    core = {"loss/policy", "loss/sdpo", "loss/total", "sdpo/skipped"}
    if policy_loss == "clipped_surrogate":
        core.add("policy/clip_ratio")
    assert core <= set(METRIC_KEYS) and ours == core | {"sdpo/reverse_kl_k1"}
    assert not any("/" in k for k in out.metrics if not k.startswith(ADAPTER_PREFIX))


@pytest.mark.parametrize("w_policy", [0.25, 0.0])
def test_w_policy_weights_the_policy_term(make_inputs, w_policy: float) -> None:
    """loss = Σ w_t (w_policy·L^policy + α·L^sdpo) (issue 60): the gradient of the kept DPPO token (A = −1, ρ = 1.5)
    is w_policy·1.5, the distilled token's 0.5·ln 2; a sample without a teacher trains on w_policy·policy alone."""
    args = {"p_train": [0.9, 0.5], "p_inf": [0.6, 0.5], "adv": [-1.0, 0.0], "weights": [2.0, 3.0]}
    inputs = make_inputs(**args, p_ref=[0.9, 0.25])
    out = composer_loss(inputs, alpha_sdpo=0.5, kl_tau=0.0, w_policy=w_policy)
    out.loss.backward()
    expected = torch.tensor([2.0 * 1.5 * w_policy, 3.0 * 0.5 * LN2], dtype=torch.float64)
    torch.testing.assert_close(inputs.trainer_logprobs.grad, expected, rtol=1e-12, atol=1e-15)
    full = composer_loss(make_inputs(**args, p_ref=[0.9, 0.25]), alpha_sdpo=0.5, kl_tau=0.0)
    assert out.metrics["composer/loss/policy"].item() == pytest.approx(
        full.metrics["composer/loss/policy"].item()
    )
    alone = make_inputs(**args)
    policy_only = composer_loss(alone, alpha_sdpo=0.5, kl_tau=0.0, w_policy=w_policy, sdpo_missing="skip")
    reference = composer_loss(make_inputs(**args), alpha_sdpo=0.5, kl_tau=0.0, sdpo_missing="skip")
    assert policy_only.loss.item() == pytest.approx(w_policy * reference.loss.item(), abs=1e-15)


def test_w_policy_is_core_checked() -> None:
    from composer_prime_rl.options import parse_options

    assert parse_options({"w_policy": "0.5", "alpha_sdpo": 1.0}).config.w_policy == 0.5
    with pytest.raises(ValueError, match="all 0: nothing to train"):
        parse_options({"w_policy": 0.0})
