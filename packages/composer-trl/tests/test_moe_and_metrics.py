"""Mixture-of-experts models and TRL's metric keys, against plain GRPOTrainer.

- MoE: GRPOTrainer adds the router load-balancing loss ``router_aux_loss_coef · aux_loss`` (the model's own
  coefficient by default) and logs ``aux_loss``; with channels off ComposerGRPOTrainer must train a tiny
  ``Qwen2MoeForCausalLM`` to bit-identical parameters and log the same ``aux_loss``.
- Metric keys: every key GRPOTrainer logs (``kl``, ``entropy``, ``clip_ratio/*``, ``reward``, ...) is logged by
  ComposerGRPOTrainer too, so dashboards built for TRL keep working.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch


def _train_pair(tmp_path: Path, model_dir: Path, tokenizer: Any, dataset: Any, h: Any, **opts: Any):
    """Plain GRPOTrainer, then ComposerGRPOTrainer (channels off), each built and trained from the same seed."""
    out = []
    for composer in (False, True):
        extra = {"alpha_sdpo": 0.0, "beta_replay": 0.0} if composer else {}
        args = h.grpo_args(tmp_path / str(composer), composer=composer, **extra, **opts)
        torch.manual_seed(0)
        trainer = h.make_trainer(model_dir, tokenizer, dataset, args, composer=composer)
        torch.manual_seed(0)  # generation samples from torch's global generator
        trainer.train()
        out.append(trainer)
    return out[0], out[1]


def _logged(trainer: Any) -> list[dict[str, float]]:
    return [r for r in trainer.state.log_history if "reward" in r]


def test_moe_one_step_bit_identical_to_grpo_trainer(tmp_path, moe_dir, tokenizer, dataset, h):
    plain, comp = _train_pair(tmp_path, moe_dir, tokenizer, dataset, h, max_steps=1)
    assert plain.aux_loss_enabled and comp.aux_loss_enabled
    assert plain.router_aux_loss_coef == pytest.approx(0.001)
    p_params = dict(plain.model.named_parameters())
    c_params = dict(comp.model.named_parameters())
    assert p_params.keys() == c_params.keys()
    differ = [n for n in p_params if not torch.equal(p_params[n], c_params[n])]
    assert not differ, differ[:5]
    (p_log,), (c_log,) = _logged(plain), _logged(comp)
    assert "aux_loss" in p_log
    assert c_log["aux_loss"] == p_log["aux_loss"] > 0
    assert c_log["loss"] == p_log["loss"]


def test_moe_aux_loss_moves_the_router(tmp_path, moe_dir, tokenizer, dataset, h):
    """The test above can fail: without the aux loss the router weights train differently."""
    _plain, comp = _train_pair(
        tmp_path, moe_dir, tokenizer, dataset, h, max_steps=1, router_aux_loss_coef=0.0
    )
    no_aux = dict(comp.model.named_parameters())
    with_aux = h.make_trainer(
        moe_dir,
        tokenizer,
        dataset,
        h.grpo_args(tmp_path / "aux", alpha_sdpo=0.0, beta_replay=0.0, max_steps=1),
    )
    with_aux.train()
    gates = [n for n, p in with_aux.model.named_parameters() if n.endswith("mlp.gate.weight")]
    assert gates
    assert any(not torch.equal(dict(with_aux.model.named_parameters())[n], no_aux[n]) for n in gates)
    assert "aux_loss" not in _logged(comp)[0]


@pytest.mark.parametrize("beta", [0.0, 0.04])
def test_logged_metric_keys_contain_grpo_trainers(tmp_path, model_dir, tokenizer, dataset, h, beta):
    """Same keys (and, channels off, the same values) as GRPOTrainer; beta > 0 at TRL's default KL."""
    plain, comp = _train_pair(tmp_path, model_dir, tokenizer, dataset, h, max_steps=2, beta=beta)
    p_logs, c_logs = _logged(plain), _logged(comp)
    assert len(p_logs) == len(c_logs) == 2
    for p, c in zip(p_logs, c_logs):
        missing = set(p) - set(c)
        assert not missing, sorted(missing)
        for key in ("loss", "kl", "entropy", "clip_ratio/low_mean", "clip_ratio/high_max", "reward"):
            if key in p:
                assert c[key] == p[key] or (c[key] != c[key] and p[key] != p[key]), key
    assert ("kl" in p_logs[0]) == (beta > 0)
    for name, p in plain.model.named_parameters():
        assert torch.equal(p, dict(comp.model.named_parameters())[name]), name
