"""The core conformance suite through the adapter's loss assembly (composer_trl.loss)."""

from __future__ import annotations

import dataclasses
import tempfile
from collections.abc import Mapping
from typing import Any

import pytest
import torch
from composer_core.loss.compose import ComposerBatch
from composer_core.testing import check_adapter
from composer_core.testing.conformance import CASES, cases_for
from composer_trl import ComposerGRPOConfig
from composer_trl.loss import Counts, composer_trl_loss
from torch import Tensor

CONFORMANCE_SUPPORTS = frozenset(
    {"policy", "sdpo_full", "sdpo_sampled", "sdpo_topk", "sdpo_compiled", "taid", "entropy_opd", "dpo", "simpo",
     "global_normalizer"}
)  # fmt: skip
"""Conformance tags this adapter implements."""

_RENAMED = {"epsilon_low": "epsilon", "kl_beta": "beta"}


def conformance_compute(batch: ComposerBatch, options: Mapping[str, Any]) -> Tensor:
    """Host-side path for :func:`composer_core.testing.check_adapter`: compose_loss options → a
    ``ComposerGRPOConfig`` → its ``compose_config`` → :func:`composer_trl_loss` (one process, no accumulation).

    Global normalisers map to the counts the trainer gathers (``normalizer`` → TRL's
    ``num_items_in_batch``, ``sdpo_normalizer`` → hinted tokens, ``replay_normalizer`` → pairs).
    """
    same = {f.name for f in dataclasses.fields(ComposerGRPOConfig)}
    kwargs: dict[str, Any] = {"alpha_sdpo": 1.0, "beta_replay": 1.0}
    counts: dict[str, Tensor] = {}
    taid_t: float | None = None
    for key, value in options.items():
        if key in _RENAMED:
            kwargs[_RENAMED[key]] = value
        elif key == "sdpo_form":
            if value not in ("sampled", "full", "topk", "auto"):
                raise ValueError(
                    f"sdpo_form={value!r} is not a ComposerGRPOConfig option (full|sampled|topk)."
                )
            kwargs["sdpo_form"] = "full" if value == "auto" else value
        elif key == "taid_t":
            taid_t = float(value)
        elif key in ("normalizer", "sdpo_normalizer", "replay_normalizer"):
            counts[key] = torch.as_tensor(float(value), dtype=torch.float64)
        elif key in same:  # the same name here as in compose_loss
            kwargs[key] = value
        else:
            raise ValueError(f"compose_loss option {key!r} has no ComposerGRPOConfig counterpart.")
    if kwargs.get("beta", 0.0) != 0.0:
        kwargs["use_bias_correction_kl"] = False
    if kwargs.get("sdpo_wrapper") == "taid":
        kwargs["max_steps"] = 1000
    if "normalizer" in counts and kwargs.get("loss_type", "dapo") != "dapo":
        raise ValueError(
            "a global policy normalizer maps to TRL's num_items_in_batch, i.e. loss_type='dapo'."
        )
    with tempfile.TemporaryDirectory() as tmp:
        args = ComposerGRPOConfig(
            output_dir=tmp,
            report_to="none",
            use_cpu=True,
            max_completion_length=batch.logprobs.shape[1],
            **kwargs,
        )
    c = Counts(
        num_items=counts.get("normalizer"),
        sdpo_items=counts.get("sdpo_normalizer"),
        replay_items=counts.get("replay_normalizer"),
    )
    loss, _ = composer_trl_loss(batch, args.compose_config, c, taid_now=taid_t)
    return loss


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_core_conformance_suite_passes_through_the_adapter(dtype):
    atol, rtol = (1e-9, 1e-7) if dtype == torch.float64 else (1e-5, 1e-4)
    report = check_adapter(
        conformance_compute, supports=set(CONFORMANCE_SUPPORTS), atol=atol, rtol=rtol, dtype=dtype
    )
    assert len(report.passed) == len(cases_for(CONFORMANCE_SUPPORTS)) > 10
    assert not report.skipped  # every case, top-k included (sdpo_form='topk')


def test_unsupported_option_is_reported_not_ignored():
    case = next(c for c in CASES if "sdpo_full" in c.tags)
    with pytest.raises(ValueError, match="sdpo_form"):
        conformance_compute(case.make_batch(torch.float64), {**case.options, "sdpo_form": "chunked"})


# Options whose conformance cases only use the default value (or none at all): a wrong or missing
# mapping in composer_trl_loss would pass the suite above, so each is checked on its own here:
# (case, options of the baseline, the option under test).
_EOPD = {"sdpo_wrapper": "entropy_opd"}
_SIMPO = {"dpo_variant": "simpo"}
_FORWARDED = [
    ("sdpo_full", {}, {"dpo_beta": 0.5}),
    ("sdpo_full", {}, {"dpo_loss_type": "robust", "dpo_label_smoothing": 0.2}),
    ("sdpo_full", {}, {"dpo_loss_type": "ipo"}),
    ("sdpo_full", {}, {"dpo_label_smoothing": 0.3}),
    ("sdpo_full", {}, {"sdpo_beta": 0.9}),
    ("sdpo_full", {}, {"sdpo_temperature": 1.7}),
    ("sdpo_full", {}, {"sdpo_wrapper": "taid", "taid_t": 0.3}),
    ("sdpo_full", _EOPD, {"entropy_opd_threshold": 0.0}),
    ("sdpo_full", _EOPD, {"entropy_opd_weight": 3.0}),
    ("simpo", _SIMPO, {"simpo_beta": 4.0}),
    ("simpo", _SIMPO, {"simpo_gamma": 2.0}),
]


@pytest.mark.parametrize(("case_tag", "base", "option"), _FORWARDED, ids=[str(o) for *_, o in _FORWARDED])
def test_each_config_option_reaches_compose_loss(case_tag, base, option):
    from composer_core import compose_loss

    case = next(c for c in CASES if c.name == f"{case_tag}/random_three_channels")
    opts = {**base, **option}
    without = conformance_compute(case.make_batch(torch.float64), base).detach()
    got = conformance_compute(case.make_batch(torch.float64), opts).detach()
    want = compose_loss(case.make_batch(torch.float64), alpha_sdpo=1.0, beta_replay=1.0, **opts).total
    torch.testing.assert_close(got, want.detach(), atol=1e-10, rtol=1e-9)
    assert abs(float(got) - float(without)) > 1e-6, f"{option} did not change the loss"
