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
    # only top-k cases are skipped (the adapter always distils the full vocabulary)
    skipped = {c.name for c in CASES if c.name in report.skipped}
    assert all("sdpo_topk" in c.tags for c in CASES if c.name in skipped)


def test_unsupported_option_is_reported_not_ignored():
    from composer_core.testing.conformance import CASES

    case = next(c for c in CASES if "sdpo_topk" in c.tags)
    with pytest.raises(ValueError, match="sdpo_form"):
        conformance_compute(case.make_batch(torch.float64), dict(case.options))
