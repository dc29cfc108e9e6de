"""The two differences from TRL's ``SDPOTrainer`` that ``ComposerGRPOTrainer`` inherits from ``GRPOTrainer``
(README, "Differences inherited from GRPOTrainer"), each shown on the real code path:

- ``loss_type="dapo"`` with several micro-batches per generation batch: the policy term's normaliser is the whole
  generation batch's token count × accumulation / steps-per-generation (TRL's ``num_items_in_batch``), not the
  micro-batch's own token count (``SDPOTrainer._compute_policy_loss``).
- ``GRPOTrainer`` shuffles the generation batch's rows before splitting it into micro-batches; ``SDPOTrainer``
  does not.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

pytest.importorskip("trl.experimental.sdpo")


def test_dapo_policy_normaliser_spans_the_generation_batch() -> None:
    """Two micro-batches of one generation batch (steps_per_generation=2, no accumulation) holding 5 and 3 completion
    tokens: composer's (GRPOTrainer's) dapo divides each micro-batch's sum by (5 + 3) / 2 = 4, SDPOTrainer by 5 and 3."""
    from composer_core.loss.compose import ComposerBatch
    from composer_trl import ComposerGRPOConfig
    from composer_trl.loss import Counts, composer_trl_loss

    args = ComposerGRPOConfig(output_dir="unused", report_to="none", use_cpu=True, loss_type="dapo")
    counts = Counts(num_items=torch.tensor(8.0), accumulation=1, steps_per_generation=2)
    for tokens in (5, 3):
        mask = torch.zeros(2, 4)
        mask.view(-1)[:tokens] = 1
        lp = torch.full((2, 4), -1.0, requires_grad=True)
        batch = ComposerBatch(logprobs=lp, advantages=torch.tensor([1.0, -0.5]), completion_mask=mask)
        loss, _ = composer_trl_loss(batch, args.compose_config, counts)
        per_token = -torch.tensor([[1.0] * 4, [-0.5] * 4])  # on-policy: ratio 1, L = −A
        total = (per_token * mask).sum()
        assert torch.equal(loss.detach(), total / 4.0)  # (5 + 3) / 2: the generation batch's count
        assert not torch.equal(loss.detach(), total / tokens)  # SDPOTrainer's per-micro-batch normaliser


def _first_micro_batch(trainer: Any) -> list[str]:
    seen: list[list[str]] = []
    real = trainer.compute_loss

    def spy(model: Any, inputs: dict[str, Any], *a: Any, **k: Any) -> Any:
        seen.append(trainer.processing_class.batch_decode(inputs["prompt_ids"], skip_special_tokens=True))
        return real(model, inputs, *a, **k)

    trainer.compute_loss = spy
    trainer.train()
    return seen[0]


def test_grpo_shuffles_rows_before_splitting_micro_batches(tmp_path, model_dir, tokenizer, dataset) -> None:
    """steps_per_generation=2: SDPOTrainer's first micro-batch is the generation batch's first half (prompts 0 and
    1, each num_generations times, in order); ComposerGRPOTrainer's (GRPOTrainer's) is a shuffled selection."""
    from composer_core.tasks.digit_reversal import reverse_reward
    from composer_trl import ComposerGRPOConfig, ComposerGRPOTrainer
    from transformers import AutoModelForCausalLM
    from trl.experimental.sdpo import SDPOConfig, SDPOTrainer

    common: dict[str, Any] = {
        "per_device_train_batch_size": 8, "num_generations": 4, "max_completion_length": 2, "max_steps": 1,
        "steps_per_generation": 2, "report_to": "none", "use_cpu": True, "save_strategy": "no",
        "disable_tqdm": True, "seed": 0, "shuffle_dataset": False, "bf16": False,
    }  # fmt: skip
    first_half = [p.rstrip() for p in [dataset[0]["prompt"]] * 4 + [dataset[1]["prompt"]] * 4]
    trl = SDPOTrainer(
        model=AutoModelForCausalLM.from_pretrained(model_dir), reward_funcs=[reverse_reward],
        args=SDPOConfig(output_dir=str(tmp_path / "trl"), **common), train_dataset=dataset, processing_class=tokenizer,
    )  # fmt: skip
    assert _first_micro_batch(trl) == first_half
    cmp = ComposerGRPOTrainer(
        model=AutoModelForCausalLM.from_pretrained(model_dir), reward_funcs=[reverse_reward],
        args=ComposerGRPOConfig(output_dir=str(tmp_path / "cmp"), **common), train_dataset=dataset,
        processing_class=tokenizer,
    )  # fmt: skip
    rows = _first_micro_batch(cmp)
    assert sorted(rows) != sorted(first_half)  # rows of both halves were mixed by the shuffle
    assert set(rows) <= {dataset[i]["prompt"] for i in range(4)}  # still rows of this generation batch
