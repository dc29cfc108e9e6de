"""Channel names agree everywhere: ``ComposeResult.policy/sdpo/replay`` and the metric keys of
:data:`composer_core.METRIC_KEYS` (``<group>/<name>``), the one source of truth the adapters log under
``composer/`` and composer-core's README documents."""

from __future__ import annotations

import dataclasses
import re
import warnings
from pathlib import Path

import pytest
import torch
from composer_core import (
    ADAPTER_PREFIX,
    GRAD_NORM_KEYS,
    METRIC_KEYS,
    OPTIONAL_METRIC_KEYS,
    ComposerBatch,
    ComposeResult,
)
from composer_core import compose_loss as core_compose_loss


def compose_loss(batch: ComposerBatch, config: object = None, /, **options: object):  # type: ignore[no-untyped-def]
    """core's ``compose_loss`` with channels 2 and 3 on (weight 1) unless the test sets their weights (core's
    defaults are 0)."""
    if config is None:
        options = {"alpha_sdpo": 1.0, "beta_replay": 1.0, **options}
    return core_compose_loss(batch, config, **options)  # type: ignore[arg-type]


D = torch.float64
B, T, V, P = 2, 3, 5, 2


def _batch(*, kl: bool = False, rollout: bool = False) -> ComposerBatch:
    g = torch.Generator().manual_seed(0)
    r = lambda *s: torch.randn(*s, generator=g, dtype=D)  # noqa: E731
    return ComposerBatch(
        logprobs=(r(B, T) - 1).requires_grad_(True),
        advantages=torch.tensor([1.0, -1.0], dtype=D),
        completion_mask=torch.ones(B, T),
        ref_logprobs=r(B, T) - 1 if kl else None,
        inference_logprobs=r(B, T) - 1 if rollout else None,
        student_logits=r(B, T, V).requires_grad_(True),
        teacher_logits=r(B, T, V),
        chosen_logps=r(P).requires_grad_(True),
        rejected_logps=r(P).requires_grad_(True),
        ref_chosen_logps=r(P),
        ref_rejected_logps=r(P),
        chosen_lengths=torch.tensor([2, 3]),
        rejected_lengths=torch.tensor([3, 1]),
    )


def test_three_channel_batch_returns_exactly_the_documented_keys() -> None:
    r = compose_loss(_batch())
    assert set(r.metrics) == set(METRIC_KEYS) - OPTIONAL_METRIC_KEYS


def test_every_option_metric_is_documented_and_every_documented_key_occurs() -> None:
    tis = compose_loss(
        _batch(kl=True, rollout=True),
        kl_beta=0.1,
        rollout_correction="token_truncate",
        sdpo_wrapper="taid",
        taid_t=0.4,
    )
    dppo = compose_loss(_batch(rollout=True), rollout_correction="dppo_mask")
    # the grad_norm/* keys are the adapters' (compose_loss has no parameters to differentiate)
    assert set(tis.metrics) == set(METRIC_KEYS) - {"policy/dppo_masked", "policy/skipped"} - GRAD_NORM_KEYS
    assert (
        set(dppo.metrics)
        == set(METRIC_KEYS)
        - {
            "policy/kl",
            "policy/rollout_is_weight",
            "taid/t",
            "policy/skipped",
        }
        - GRAD_NORM_KEYS
    )
    pure = compose_loss(_batch(), w_policy=0.0)  # pure self-distillation: no policy term, no policy keys
    assert set(pure.metrics) == set(METRIC_KEYS) - OPTIONAL_METRIC_KEYS - {
        "loss/policy",
        "policy/clip_ratio",
    } | {"policy/skipped"}


def test_skipped_channels_drop_their_counts_and_losses() -> None:
    b = _batch()
    b = dataclasses.replace(b, **dict.fromkeys(f.name for f in dataclasses.fields(b) if f.default is None))
    r = compose_loss(
        b, alpha_sdpo=0.0, beta_replay=0.0
    )  # a policy-only batch: channel inputs at weight 0 raise
    assert set(r.metrics) == {
        "loss/total",
        "loss/policy",
        "policy/clip_ratio",
        "sdpo/skipped",
        "replay/skipped",
    }
    assert r.metrics["sdpo/skipped"] == 1.0 and r.metrics["replay/skipped"] == 1.0


def test_keys_are_group_slash_name_with_the_channel_groups() -> None:
    for key in METRIC_KEYS:
        assert re.fullmatch(r"(loss|policy|sdpo|replay|taid|grad_norm)/[a-z_]+", key), key
    assert {k.split("/")[1] for k in GRAD_NORM_KEYS} == {"policy", "sdpo", "replay"}
    assert {k for k in METRIC_KEYS if k.startswith("loss/")} == {
        "loss/total",
        "loss/policy",
        "loss/sdpo",
        "loss/replay",
    }
    assert set(METRIC_KEYS) >= OPTIONAL_METRIC_KEYS and ADAPTER_PREFIX == "composer/"


def test_result_fields_are_the_channel_names() -> None:
    assert [f.name for f in dataclasses.fields(ComposeResult)] == [
        "total",
        "policy",
        "sdpo",
        "replay",
        "metrics",
    ]
    r = compose_loss(_batch(), alpha_sdpo=0.5, beta_replay=0.25)
    assert r.sdpo is not None and r.replay is not None
    torch.testing.assert_close(r.total, r.policy + 0.5 * r.sdpo + 0.25 * r.replay, rtol=0, atol=0)
    assert r.metrics["loss/sdpo"] == float(r.sdpo.detach()) and r.metrics["loss/replay"] == float(
        r.replay.detach()
    )


def test_old_metric_names_still_read_with_a_deprecation_warning() -> None:
    r = compose_loss(_batch(), alpha_sdpo=1.0, beta_replay=1.0)
    assert not hasattr(r, "distill") and not hasattr(r, "preference")  # the result's aliases are removed
    with pytest.warns(DeprecationWarning, match="sdpo/skipped"):
        assert r.metrics["skipped/sdpo"] == 0.0
    with pytest.warns(DeprecationWarning, match="replay/skipped"):
        assert "skipped/replay" in r.metrics
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert r.sdpo is not None and "sdpo/skipped" in r.metrics  # the new names do not warn
    assert "skipped/sdpo" not in set(r.metrics)  # iteration shows the new keys only


def test_readme_naming_table_lists_exactly_the_keys() -> None:
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text(encoding="utf-8")
    block = readme.split("<!-- metric-keys:begin -->")[1].split("<!-- metric-keys:end -->")[0]
    documented = re.findall(r"^\| `([a-z_]+/[a-z_]+)` \|", block, flags=re.M)
    assert documented == list(METRIC_KEYS)
