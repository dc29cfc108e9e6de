"""composer_core's ``rpo_alpha`` against TRL 1.16's own ``DPOTrainer`` with ``loss_type=["sigmoid", "sft"]``,
``loss_weights=[1, alpha]`` (TRL's RPO), on the log-probs TRL's own forward computed."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from composer_core import DPO, dpo_loss


def _trl_batch_loss(tmp_path, model_dir, tokenizer, rows: list[dict[str, str]], alpha: float):
    from datasets import Dataset
    from trl import DPOConfig, DPOTrainer

    args = DPOConfig(
        output_dir=str(tmp_path / "dpo"), loss_type=["sigmoid", "sft"], loss_weights=[1.0, alpha], beta=0.1,
        per_device_train_batch_size=len(rows), report_to="none", use_cpu=True, bf16=False, seed=0,
    )  # fmt: skip
    trainer = DPOTrainer(
        model=str(model_dir), args=args, train_dataset=Dataset.from_list(rows), processing_class=tokenizer
    )
    with torch.no_grad():  # move the policy off the reference so the DPO margin is not 0
        g = torch.Generator().manual_seed(0)
        for p in trainer.model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))
    seen: list[torch.Tensor] = []

    def keep(module: Any, args: Any, output: Any) -> None:
        seen.append(output.log_probs.detach())

    hooks = [m.register_forward_hook(keep) for m in (trainer.model, trainer.ref_model)]
    batch = next(iter(trainer.get_train_dataloader()))
    loss = trainer.compute_loss(trainer.model, batch)
    for h in hooks:
        h.remove()
    policy, ref = seen  # TRL's forward of the policy, then of its reference model
    shift = batch["completion_mask"][..., 1:]
    c, r = policy[:, -shift.size(1) :].sum(1).chunk(2)
    rc, rr = ref[:, -shift.size(1) :].sum(1).chunk(2)
    lengths = shift.sum(1).chunk(2)[0]
    return float(loss.detach()), (c, r, rc, rr), lengths


def _rows(answers: list[str]) -> list[dict[str, str]]:
    return [{"prompt": f"{i}{i}", "chosen": a, "rejected": a[::-1] + "1"} for i, a in enumerate(answers)]


@pytest.mark.parametrize("alpha", [0.0, 0.5])
def test_rpo_alpha_equals_trls_sigmoid_plus_sft(alpha, tmp_path, model_dir, tokenizer):
    trl, (c, r, rc, rr), lengths = _trl_batch_loss(
        tmp_path, model_dir, tokenizer, _rows(["123", "456", "789", "012"]), alpha
    )
    assert torch.all(lengths == lengths[0])  # one chosen length: TRL's token mean is the per-pair mean
    ours = dpo_loss(
        c, r, rc, rr, options=DPO(beta=0.1, rpo_alpha=alpha), chosen_lengths=lengths if alpha else None
    )
    assert float(ours) == pytest.approx(trl, rel=1e-6)
    assert abs(float(dpo_loss(c, r, rc, rr)) - float(ours)) > 1e-3 or alpha == 0.0


def test_unequal_chosen_lengths_differ_from_trls_token_mean_as_documented(tmp_path, model_dir, tokenizer):
    trl, (c, r, rc, rr), lengths = _trl_batch_loss(
        tmp_path, model_dir, tokenizer, _rows(["1", "45678", "78", "0123"]), 0.5
    )
    assert len(set(lengths.tolist())) > 1
    ours = dpo_loss(c, r, rc, rr, options=DPO(beta=0.1, rpo_alpha=0.5), chosen_lengths=lengths)
    token_mean = dpo_loss(c, r, rc, rr) + 0.5 * (-c.sum() / lengths.sum())  # TRL's sft term
    assert float(token_mean) == pytest.approx(trl, rel=1e-6)
    assert float(ours) == pytest.approx(
        float(dpo_loss(c, r, rc, rr) + 0.5 * (-c / lengths).mean()), rel=1e-12
    )
