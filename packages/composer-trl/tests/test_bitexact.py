"""Channels off (alpha_sdpo = beta_replay = 0): loss and gradients equal plain GRPOTrainer's bit for bit.

Both trainers load the same saved model; one generation batch from the plain trainer feeds both
`compute_loss` calls. Old log-probs are perturbed so the clip region is exercised (num_iterations=2 makes
TRL carry `old_per_token_logps`), and `beta != 0` runs the k3 KL against TRL's reference model.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

CASES = [
    {"loss_type": "grpo"},
    {"loss_type": "bnpo"},
    {"loss_type": "dr_grpo"},
    {"loss_type": "dapo"},
    {"loss_type": "dapo", "beta": 0.04, "use_bias_correction_kl": False},
    {"loss_type": "dapo", "beta": 0.04},  # TRL's default KL: use_bias_correction_kl=True
    {"loss_type": "grpo", "beta": 0.1, "delta": 1.5},
    {"loss_type": "grpo", "epsilon_high": 0.28, "delta": 1.5},
    {"loss_type": "dapo", "gradient_accumulation_steps": 2},
    {"loss_type": "grpo", "gradient_accumulation_steps": 2},  # TRL's loss / G: composer's objective / G
]


def _loss_and_grads(trainer: Any, inputs: dict[str, Any]) -> tuple[torch.Tensor, list[torch.Tensor]]:
    trainer.model.train()
    trainer.model.zero_grad()
    loss = trainer.compute_loss(trainer.model, inputs)
    loss.backward()
    grads = [p.grad.clone() for p in trainer.model.parameters() if p.grad is not None]
    return loss.detach(), grads


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()))
def test_channels_off_equals_plain_grpo_bitwise(
    case: dict[str, Any], tmp_path, model_dir, tokenizer, dataset, h
):
    opts = {"num_iterations": 2, **case}
    plain = h.make_trainer(
        model_dir, tokenizer, dataset, h.grpo_args(tmp_path, composer=False, **opts), composer=False
    )
    comp = h.make_trainer(
        model_dir, tokenizer, dataset, h.grpo_args(tmp_path, alpha_sdpo=0.0, beta_replay=0.0, **opts)
    )
    gas = opts.get("gradient_accumulation_steps", 1)
    for t in (plain, comp):
        t.current_gradient_accumulation_steps = gas
    torch.manual_seed(0)
    plain.model.train()
    inputs = plain._generate_and_score_completions(h.generation_batch(dataset, 2, 4))
    assert "old_per_token_logps" in inputs
    g = torch.Generator().manual_seed(1)
    inputs["old_per_token_logps"] = inputs["old_per_token_logps"] + 0.3 * torch.randn(
        inputs["old_per_token_logps"].shape, generator=g
    )
    if inputs["advantages"].abs().sum() == 0:  # make sure the surrogate has a gradient
        inputs["advantages"] = torch.linspace(-1.5, 1.5, inputs["advantages"].numel())

    loss_p, grads_p = _loss_and_grads(plain, inputs)
    loss_c, grads_c = _loss_and_grads(comp, inputs)
    assert torch.equal(loss_p, loss_c), (loss_p.item(), loss_c.item())
    assert len(grads_p) == len(grads_c) > 0
    for gp, gc in zip(grads_p, grads_c):
        assert torch.equal(gp, gc)
    assert any(gp.abs().sum() > 0 for gp in grads_p)
    # the clip region was exercised, so the comparison covers the clipped branch too
    assert plain._metrics["train"]["clip_ratio/region_mean"][-1] > 0
    # every metric TRL logs from its loss, same name and value (kl is the bias-corrected one where TRL's is)
    for key, values in plain._metrics["train"].items():
        if key in ("clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean", "kl", "entropy"):
            assert comp._metrics["train"][key][-1] == values[-1], key
    for key in ("clip_ratio/low_min", "clip_ratio/high_max"):
        a, b = comp._metrics["train"][key][-1], plain._metrics["train"][key][-1]
        assert a == b or (a != a and b != b), key


@pytest.mark.parametrize("loss_type", ["dapo", "grpo", "bnpo"])
def test_all_masked_micro_batches_train_with_loss_zero_like_grpo_trainer(
    loss_type, tmp_path, model_dir, tokenizer, dataset, h
):
    """TRL's reproduction (issue 50): mask_truncated_completions with max_completion_length=1 masks every
    completion that does not end at once; GRPOTrainer trains on with loss 0 (accumulation 2), and so must the
    swap, bit for bit, with the channels off and with channel 2 on (global normaliser)."""
    from composer_core.tasks.digit_reversal import reverse_hints
    from transformers import AutoModelForCausalLM

    opts = {
        "loss_type": loss_type, "mask_truncated_completions": True, "max_completion_length": 1,
        "max_steps": 4, "gradient_accumulation_steps": 2, "per_device_train_batch_size": 4,
    }  # fmt: skip
    runs = {}
    for name, composer, extra in (
        ("grpo", False, {}),
        ("swap", True, {"alpha_sdpo": 0.0, "beta_replay": 0.0}),
        ("sdpo", True, {"beta_replay": 0.0}),
    ):
        args = h.grpo_args(tmp_path / name, composer=composer, **opts, **extra)
        model = AutoModelForCausalLM.from_pretrained(model_dir)
        hints = {"hint_fn": reverse_hints} if name == "sdpo" else {}
        trainer = h.make_trainer(model, tokenizer, dataset, args, composer=composer, **hints)
        trainer.train()
        runs[name] = (trainer, [r["loss"] for r in trainer.state.log_history if "loss" in r])
    grpo, swap = runs["grpo"], runs["swap"]
    assert len(grpo[1]) == 4 and grpo[1] == swap[1]
    for (n, a), (_, b) in zip(grpo[0].model.named_parameters(), swap[0].model.named_parameters()):
        assert torch.equal(a, b), n
    assert len(runs["sdpo"][1]) == 4
