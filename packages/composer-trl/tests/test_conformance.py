"""The core conformance suite through the adapter's loss assembly (composer_trl.loss)."""

from __future__ import annotations

import pytest
import torch
from composer_core.testing import check_adapter
from composer_core.testing.conformance import CASES, cases_for
from composer_trl.loss import CONFORMANCE_SUPPORTS, conformance_compute


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
