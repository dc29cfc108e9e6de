"""composer_core's conformance suite through the PRIME-RL adapter.

``compute`` below is the host-side path: it splits a ``ComposerBatch`` into PRIME-RL samples
(one ``LossInputs`` per row, ``inference_logprobs`` = the batch's old log-probs, the sampled
tokens' teacher log-probs as ``ref_logprobs``), calls ``composer_loss`` once per sample as the
trainer does, and divides the sum by the rl-token count (``normalizer`` when the case gives
one: PRIME-RL's all-reduced ``rl_scale``).

Tags: ``policy``, ``sdpo_sampled`` and ``global_normalizer``. Three of their cases ask for
something a per-sample PRIME-RL loss cannot express; the adapter must refuse them with its
clear error instead of returning a different number, and every other case must match
``compose_loss`` in value and gradient.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import pytest
import torch
from composer_core.loss.compose import ComposerBatch, compose_loss
from composer_core.loss.config import flat_defaults
from composer_core.testing import ConformanceError, cases_for, check_adapter
from composer_prime_rl import LossInputs, composer_loss

SUPPORTS = {"policy", "sdpo_sampled", "global_normalizer"}

# compose_loss options with a PRIME-RL meaning; every other one goes to composer_loss, which
# accepts it (same name) or refuses it with its explanation.
_TRANSLATED = {"loss_type", "normalizer", "sdpo_normalizer", "alpha_sdpo", "beta_replay", "sdpo_form"}

_CORE_DEFAULTS = {k: flat_defaults()[k] for k in ("alpha_sdpo", "beta_replay")}

NOT_EXPRESSIBLE = {
    "policy/clip_higher_grpo": "divides by the global rl-token count",  # per-sequence mean
    "policy/kl_k3": "KL-to-reference penalty",  # ref_logprobs are the hinted teacher here
    # the hint mask leaves out sample 0: compose_loss divides channel 2 by its own (smaller) count
    "sdpo_sampled/random_is_clip": "divides channel 2 by the rl-token count",
}


def compute(
    batch: ComposerBatch, options: Mapping[str, Any], *, refuse_sdpo_count: bool = True
) -> torch.Tensor:
    opts = dict(options)
    kwargs: dict[str, Any] = {k: v for k, v in opts.items() if k not in _TRANSLATED}
    kwargs["policy_loss"] = "clipped_surrogate"  # composer's channel 1 (the DPPO form is not in the suite)
    loss_type = opts.get("loss_type", "dapo")
    if loss_type not in ("dapo", "bnpo"):  # token-level sums are all PRIME-RL does
        kwargs["loss_type"] = loss_type  # composer_loss raises its explanation
    opts = {**_CORE_DEFAULTS, **opts}  # the case's options over core's defaults
    if batch.chosen_logps is not None and opts["beta_replay"] != 0:
        kwargs["beta_replay"] = opts["beta_replay"]  # composer_loss raises: channel 3

    mask = batch.completion_mask.bool()
    rl_scale = float(opts.get("normalizer") or mask.sum())
    teacher = batch.teacher_logprobs
    alpha = float(opts["alpha_sdpo"]) if teacher is not None else 0.0
    if alpha:
        kwargs["alpha_sdpo"] = alpha
        kwargs["sdpo_missing"] = "skip"  # a row without hint tokens ships no ref_logprobs
        hint = mask if batch.sdpo_mask is None else batch.sdpo_mask.bool()
        for row in range(mask.shape[0]):
            if hint[row].any() and not torch.equal(hint[row], mask[row]):
                raise ValueError(
                    "PRIME-RL has one loss_mask per sample: channel 2 runs on the rl tokens of the "
                    "samples that carry ref_logprobs"
                )
        sdpo_count = float(opts.get("sdpo_normalizer") or hint.sum())
        if refuse_sdpo_count and sdpo_count != rl_scale:
            raise ValueError("PRIME-RL divides channel 2 by the rl-token count, like channel 1")

    old = batch.old_logprobs if batch.old_logprobs is not None else batch.logprobs.detach()
    adv = batch.advantages if batch.advantages.dim() == 2 else batch.advantages[:, None].expand_as(mask)
    total = batch.logprobs.sum() * 0.0
    for row in range(mask.shape[0]):
        has_hint = teacher is not None and bool(
            (mask[row] if batch.sdpo_mask is None else batch.sdpo_mask[row].bool()).any()
        )
        inputs = LossInputs(
            trainer_logprobs=batch.logprobs[row],
            inference_logprobs=old[row],
            ref_logprobs=teacher[row] if has_hint and teacher is not None else None,
            advantages=adv[row],
            loss_mask=mask[row],
        )
        total = total + composer_loss(inputs, **kwargs).loss
    return total / rl_scale


def test_conformance_suite_through_the_adapter() -> None:
    selected = [c.name for c in cases_for(SUPPORTS)]
    assert set(NOT_EXPRESSIBLE) <= set(selected)
    with pytest.raises(ConformanceError) as err:
        check_adapter(compute, supports=SUPPORTS, atol=1e-10, rtol=1e-9)
    failures = [line.strip() for line in str(err.value).splitlines()[1:]]
    # exactly the inexpressible cases fail, each refused with the adapter's explanation
    assert len(failures) == len(NOT_EXPRESSIBLE), failures
    for name, reason in NOT_EXPRESSIBLE.items():
        (line,) = [f for f in failures if f.startswith(f"[{name}]")]
        assert "the adapter raised ValueError" in line and reason in line, line


def test_expressible_cases_pass() -> None:
    expressible = {c.name for c in cases_for(SUPPORTS)} - set(NOT_EXPRESSIBLE)
    assert expressible == {
        "policy/ratio_one_dapo",
        "policy/ratio_one_global_normalizer",
        "policy/random_bnpo_delta",
        "sdpo_sampled/check_value",
    }
    report = check_adapter(compute, supports={"sdpo_sampled"}, atol=1e-10, rtol=1e-9)
    assert report.passed == ["sdpo_sampled/check_value"]


def test_random_is_clip_differs_only_by_the_channel2_normaliser() -> None:
    """The refused sampled-token case matches compose_loss once channel 2 is divided by the
    rl-token count, as PRIME-RL does (value and gradient): the per-sample math is right, only
    the normaliser cannot be per channel in PRIME-RL."""
    (case,) = [c for c in cases_for(SUPPORTS) if c.name == "sdpo_sampled/random_is_clip"]
    ref_batch, batch = case.make_batch(torch.float64), case.make_batch(torch.float64)
    rl_count = float(ref_batch.completion_mask.sum())
    assert rl_count != float(ref_batch.sdpo_mask.sum())
    expected = compose_loss(ref_batch, **case.options, sdpo_normalizer=rl_count).total
    got = compute(batch, case.options, refuse_sdpo_count=False)
    torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-14)
    (g_ref,) = torch.autograd.grad(expected, ref_batch.logprobs)
    (g,) = torch.autograd.grad(got, batch.logprobs)
    torch.testing.assert_close(g, g_ref, rtol=1e-12, atol=1e-14)
