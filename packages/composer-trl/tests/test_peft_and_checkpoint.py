"""LoRA (peft) path and a save -> from_pretrained round trip on a local directory."""

from __future__ import annotations

import torch
from composer_core.tasks.digit_reversal import reverse_hints


def test_lora_trains_adapter_only_with_all_channels(tmp_path, model_dir, tokenizer, dataset, h):
    from peft import LoraConfig

    args = h.grpo_args(tmp_path, max_steps=2, dpo_variant="dpo")
    peft_config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    trainer = h.make_trainer(
        model_dir, tokenizer, dataset, args, hint_fn=reverse_hints, peft_config=peft_config
    )
    assert trainer._replay_ref_source == "peft_base"  # DPO reference = the base with adapters disabled
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    after = dict(trainer.model.named_parameters())
    lora = [n for n in before if "lora_" in n]
    base = [n for n in before if "lora_" not in n]
    assert lora and base
    assert any(not torch.equal(before[n], after[n]) for n in lora if "lora_B" in n)
    assert all(torch.equal(before[n], after[n]) for n in base)
    logs = [r for r in trainer.state.log_history if "reward" in r]
    assert all(r["composer/loss/sdpo"] > 0 and r["composer/loss/replay"] > 0 for r in logs)


def test_lora_on_lm_head_with_full_sdpo_is_rejected(tmp_path, model_dir, tokenizer, dataset, h):
    import pytest
    from peft import LoraConfig

    peft_config = LoraConfig(r=4, target_modules=["q_proj", "lm_head"], task_type="CAUSAL_LM")
    with pytest.raises(ValueError, match="lm_head"):
        h.make_trainer(
            model_dir,
            tokenizer,
            dataset,
            h.grpo_args(tmp_path),
            hint_fn=reverse_hints,
            peft_config=peft_config,
        )


def test_save_then_from_pretrained_round_trip(tmp_path, model_dir, tokenizer, dataset, h):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    # bf16=False: with mixed precision, accelerate wraps the live model's forward in bf16 autocast, so its
    # logits would differ from the reloaded float32 model's for that reason alone.
    args = h.grpo_args(tmp_path, max_steps=2, bf16=False)
    trainer = h.make_trainer(model_dir, tokenizer, dataset, args, hint_fn=reverse_hints)
    trainer.train()
    out = tmp_path / "saved"
    trainer.save_model(str(out))
    tokenizer.save_pretrained(out)
    reloaded = AutoModelForCausalLM.from_pretrained(out)
    tok2 = AutoTokenizer.from_pretrained(out)
    trained = trainer.accelerator.unwrap_model(trainer.model)
    for (n, p), (n2, p2) in zip(trained.state_dict().items(), reloaded.state_dict().items()):
        assert n == n2 and torch.equal(p.float(), p2.float())
    ids = tok2(["123>"], return_tensors="pt")["input_ids"]
    assert torch.equal(ids, tokenizer(["123>"], return_tensors="pt")["input_ids"])
    assert tok2.decode(ids[0]) == "123>"
    trained.eval()
    with torch.no_grad():
        torch.testing.assert_close(reloaded(ids).logits, trained(input_ids=ids).logits)
