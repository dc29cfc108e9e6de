from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import pytest
import torch
from composer_core import ComposerBatch, compose_loss
from composer_core.testing import CASES, TAGS, ConformanceError, cases_for, check_adapter


def _reference(batch: ComposerBatch, options: Mapping[str, Any]) -> torch.Tensor:
    return compose_loss(batch, **options).total


def test_compose_loss_itself_passes_every_case_and_closed_form() -> None:
    report = check_adapter(_reference, supports=set(TAGS), atol=1e-12, rtol=1e-10)
    assert report.passed == [c.name for c in CASES] and not report.skipped
    assert sum(bool(c.expected) for c in CASES) >= 14  # closed-form anchors


def test_float32_host_passes_with_float32_tolerances() -> None:
    report = check_adapter(_reference, supports={"policy", "sdpo_full", "dpo"}, dtype=torch.float32)
    assert report.passed and report.skipped


def test_supports_selects_cases() -> None:
    only_policy = cases_for({"policy"})
    assert only_policy and all(c.tags == {"policy"} for c in only_policy)
    with pytest.raises(ValueError, match="unknown conformance tag"):
        cases_for({"policy", "ppo"})
    with pytest.raises(ValueError, match="supports"):
        check_adapter(_reference, supports=set())


def test_wrong_adapters_are_caught() -> None:
    def wrong_normaliser(batch: ComposerBatch, options: Mapping[str, Any]) -> torch.Tensor:
        local = {k: v for k, v in options.items() if k != "normalizer"}  # forgets the global token count
        return compose_loss(batch, **local).total

    with pytest.raises(ConformanceError, match=r"\[policy/ratio_one_global_normalizer\] total"):
        check_adapter(wrong_normaliser, supports={"policy", "global_normalizer"})

    def beta_swapped(batch: ComposerBatch, options: Mapping[str, Any]) -> torch.Tensor:
        return compose_loss(batch, **{**options, "sdpo_beta": 1.0 - options.get("sdpo_beta", 0.5)}).total

    with pytest.raises(ConformanceError, match=r"sdpo_full/two_token_beta_0\.0"):
        check_adapter(beta_swapped, supports={"sdpo_full"})

    def detached(batch: ComposerBatch, options: Mapping[str, Any]) -> torch.Tensor:
        return compose_loss(batch, **options).total.detach()

    with pytest.raises(ConformanceError, match="does not require grad"):
        check_adapter(detached, supports={"dpo"})

    def teacher_grad(batch: ComposerBatch, options: Mapping[str, Any]) -> torch.Tensor:
        # value right, gradient wrong: scales the student gradient through a straight-through trick
        out = compose_loss(batch, **options)
        assert out.sdpo is not None
        return out.total + 0.5 * (out.sdpo - out.sdpo.detach())

    with pytest.raises(ConformanceError, match="d total / d student_logits"):
        check_adapter(teacher_grad, supports={"sdpo_full"})

    def raises(batch: ComposerBatch, options: Mapping[str, Any]) -> torch.Tensor:
        raise RuntimeError("host exploded")

    with pytest.raises(ConformanceError, match="host exploded"):
        check_adapter(raises, supports={"simpo"})


def test_cases_build_fresh_leaves() -> None:
    case = CASES[0]
    a, b = case.make_batch(torch.float64), case.make_batch(torch.float64)
    assert a.logprobs is not b.logprobs and torch.equal(a.logprobs, b.logprobs)
    assert dataclasses.is_dataclass(a)
