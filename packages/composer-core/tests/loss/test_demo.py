"""``python -m composer_core.loss.demo``: all three channels on the toy batch, combined as documented."""

from __future__ import annotations

import math

import torch
from composer_core import compose_loss
from composer_core.loss.demo import build_batch, main


def test_demo_batch_has_every_channel_and_total_is_their_weighted_sum():
    batch, params = build_batch(seed=0)
    out = compose_loss(batch, alpha_sdpo=1.0, beta_replay=0.5)
    assert out.sdpo is not None and out.replay is not None
    assert out.metrics["sdpo/skipped"] == 0.0 and out.metrics["replay/skipped"] == 0.0
    assert float(out.sdpo) > 0.0 and float(out.replay) > 0.0
    expected = out.policy + 1.0 * out.sdpo + 0.5 * out.replay
    torch.testing.assert_close(out.total, expected)
    out.total.backward()
    assert all(p.grad is not None and float(p.grad.abs().sum()) > 0.0 for p in params)


def test_demo_prints_each_channel(capsys):
    main(["--alpha-sdpo", "1.0", "--beta-replay", "0.5"])
    text = capsys.readouterr().out
    for label in ("policy (GRPO/DAPO)", "sdpo (JSD", "replay (DPO", "total", "grad norm"):
        assert label in text
    total = float(next(line for line in text.splitlines() if line.strip().startswith("total")).split(":")[1])
    assert math.isfinite(total)
