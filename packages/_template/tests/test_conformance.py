"""composer-core's conformance suite through the adapter: same value and gradient as compose_loss.

``SUPPORTS`` lists the tags the host can express; every case with only those tags must match
``compose_loss`` at float64 (``check_adapter`` raises ``ConformanceError`` listing each mismatch).
A tag the host cannot express is left out here and named in the README's "Left out".
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from composer_adapter import composer_loss
from composer_core.loss.compose import ComposerBatch, ComposeResult
from composer_core.testing import TAGS, check_adapter

SUPPORTS = set(TAGS)  # narrow this to what the host supports


def compute(batch: ComposerBatch, options: Mapping[str, Any]) -> ComposeResult:
    # Replace with the host-side path: batch -> the host's inputs -> the host's loss call.
    return composer_loss(batch, options)


def test_conformance_suite() -> None:
    report = check_adapter(compute, supports=SUPPORTS, atol=1e-8, rtol=1e-7)
    assert report.passed and not report.skipped  # every case of the supported tags ran and matched
