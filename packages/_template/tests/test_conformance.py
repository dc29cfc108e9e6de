"""composer-core's conformance suite through the adapter: same value and gradient as compose_loss.

``compute`` goes the host's way: the case's options are split into the host's config (its names) and the composer
section, built into one typed config by :func:`compose_config`; the batch travels as the host's tensors. ``SUPPORTS``
lists the tags the host can express; every case with only those tags must match ``compose_loss`` at float64
(``check_adapter`` raises ``ConformanceError`` listing each mismatch). A tag the host cannot express is left out
here and named in the README's "Left out".
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from composer_adapter import compose_config, composer_loss
from composer_adapter.config import split_options
from composer_adapter.loss import HOST_TENSORS
from composer_core import ComposerBatch, ComposeResult
from composer_core.testing import TAGS, check_adapter

SUPPORTS = set(TAGS)  # narrow this to what the host supports

_NORMALIZERS = ("normalizer", "sdpo_normalizer", "replay_normalizer")


def compute(batch: ComposerBatch, options: Mapping[str, Any]) -> ComposeResult:
    norms = {k: v for k, v in options.items() if k in _NORMALIZERS}  # the host's global counts
    host, composer = split_options({k: v for k, v in options.items() if k not in _NORMALIZERS})
    to_host = {core: name for name, core in HOST_TENSORS.items()}
    tensors = {to_host.get(f.name, f.name): getattr(batch, f.name) for f in dataclasses.fields(batch)}
    present = {k: v for k, v in tensors.items() if v is not None}
    return composer_loss(present, compose_config(host, composer), **norms)


def test_conformance_suite() -> None:
    report = check_adapter(compute, supports=SUPPORTS, atol=1e-8, rtol=1e-7)
    assert report.passed and not report.skipped  # every case of the supported tags ran and matched
