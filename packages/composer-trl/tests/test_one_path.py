"""One path from the config to the loss (issue 61): ``ComposerGRPOTrainer`` builds composer_core's
``ComposeConfig`` once, at construction, and the channels are weighted once, by ``compose_loss``.

A real training run (all three channels, TRL's per-micro-batch ``grpo`` loss with gradient accumulation, where
TRL divides its loss by the accumulation steps) counts the config builds and the weightings of the channels.
"""

from __future__ import annotations

from typing import Any

import composer_core.loss.compose as compose
import composer_trl.loss as trl_loss
import torch
from composer_core.loss.config import ComposeConfig
from composer_core.tasks.digit_reversal import reverse_hints


def test_config_built_once_and_channels_weighted_once(
    tmp_path, model_dir, tokenizer, dataset, h, monkeypatch
):
    args = h.grpo_args(
        tmp_path, loss_type="grpo", gradient_accumulation_steps=2, per_device_train_batch_size=4
    )
    trainer = h.make_trainer(model_dir, tokenizer, dataset, args, hint_fn=reverse_hints)
    builds: list[dict[str, Any]] = []
    real_from_flat = ComposeConfig.from_flat.__func__  # type: ignore[attr-defined]

    def from_flat(cls: Any, **options: Any) -> Any:
        builds.append(options)
        return real_from_flat(cls, **options)

    calls: list[str] = []
    real_weighted, real_compose = compose.weighted_total, trl_loss.compose_loss

    def weighted_total(*a: Any, **k: Any) -> torch.Tensor:
        calls.append("weighted_total")
        return real_weighted(*a, **k)

    def compose_loss(*a: Any, **k: Any) -> Any:
        calls.append("compose_loss")
        return real_compose(*a, **k)

    monkeypatch.setattr(ComposeConfig, "from_flat", classmethod(from_flat))
    monkeypatch.setattr(compose, "weighted_total", weighted_total)
    # main's adapter imported weighted_total by name and weighted the channels again with it
    monkeypatch.setattr(trl_loss, "weighted_total", weighted_total, raising=False)
    monkeypatch.setattr(trl_loss, "compose_loss", compose_loss)
    trainer.train()
    micro_batches = calls.count("compose_loss")
    assert micro_batches == 2 * 2  # max_steps × gradient_accumulation_steps
    assert calls.count("weighted_total") == micro_batches  # compose_loss's own, once per micro-batch
    assert builds == []  # no config built after construction
    rows = [r for r in trainer.state.log_history if "reward" in r]
    assert all(r["composer/loss/sdpo"] > 0 and r["composer/loss/replay"] > 0 for r in rows)
    assert trainer.compose_config is args.compose_config  # the config's own build (cached per option values)
