"""LossInputs / LossOutputs have PRIME-RL's structure (field names, order, defaults)."""

from __future__ import annotations

import dataclasses

import composer_prime_rl
from composer_prime_rl import HAS_PRIME_RL, LossInputs, LossOutputs


def test_loss_inputs_fields_match_prime_rl() -> None:
    fields = dataclasses.fields(LossInputs)
    assert [f.name for f in fields] == [
        "trainer_logprobs",
        "inference_logprobs",
        "ref_logprobs",
        "advantages",
        "loss_mask",
        "loss_weights",
    ]
    required = [
        f.name
        for f in fields
        if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
    ]
    assert required == ["trainer_logprobs", "inference_logprobs", "ref_logprobs", "advantages", "loss_mask"]
    assert next(f for f in fields if f.name == "loss_weights").default is None


def test_loss_outputs_fields_match_prime_rl() -> None:
    assert [f.name for f in dataclasses.fields(LossOutputs)] == ["loss", "metrics"]


def test_real_classes_are_used_when_prime_rl_is_importable() -> None:
    try:
        from prime_rl.trainer.rl import loss as upstream
    except ImportError:
        assert not HAS_PRIME_RL
        assert LossInputs.__module__ == "composer_prime_rl.contract"
    else:
        assert HAS_PRIME_RL
        assert LossInputs is upstream.LossInputs and LossOutputs is upstream.LossOutputs


def test_composer_loss_returns_the_contract_type(make_inputs) -> None:
    out = composer_prime_rl.composer_loss(make_inputs(p_train=[0.5], p_inf=[0.5], adv=[1.0]))
    assert type(out) is LossOutputs
    assert isinstance(out.metrics, dict)
