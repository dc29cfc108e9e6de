"""Bad options and missing channel inputs raise clear errors naming the argument and the fix."""

from __future__ import annotations

import pytest


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        ({"alpha_sdpo": -1.0}, "alpha_sdpo"),
        ({"beta_replay": float("inf")}, "beta_replay"),
        ({"sdpo_beta": 1.5}, "sdpo_beta"),
        ({"sdpo_temperature": 0.0}, "sdpo_temperature"),
        ({"sdpo_form": "topk"}, "sdpo_form"),
        ({"sdpo_form": "sampled", "sdpo_wrapper": "taid"}, "sdpo_form='full'"),
        ({"sdpo_wrapper": "taid", "max_steps": -1}, "max_steps"),
        ({"hint_template": "{prompt}"}, "hint_template"),
        ({"dpo_variant": "kto"}, "dpo_variant"),
        ({"dpo_label_smoothing": 0.6}, "dpo_label_smoothing"),
        ({"dpo_loss_type": "robust", "dpo_label_smoothing": 0.5}, "dpo_label_smoothing"),
        ({"max_replay_length": 0}, "max_replay_length"),
        ({"loss_type": "ppo"}, "loss_type"),
        ({"loss_type": "cispo", "beta_replay": 0.0, "sapo_temperature_pos": 2.0}, "sapo_temperature_pos"),
        # options of a mode that is not selected would be silently ignored: refused at construction
        ({"simpo_beta": 3.0}, "simpo_beta"),
        ({"dpo_variant": "simpo", "dpo_beta": 0.3}, "dpo_beta"),
        ({"entropy_opd_weight": 2.0}, "entropy_opd_weight"),
        ({"taid_t_start": 0.2}, "taid_t_start"),
        ({"taid_alpha": 1e-3}, "taid_alpha"),
        ({"sdpo_token_clip": 0.0}, "sdpo_token_clip"),
        # w_policy: pure self-distillation has no policy term, so no KL of it; all weights 0 is nothing to train
        ({"w_policy": 0.0, "beta": 0.04}, "kl_beta"),
        ({"w_policy": 0.0, "alpha_sdpo": 0.0, "beta_replay": 0.0}, "w_policy"),
        ({"w_policy": "-1"}, "w_policy"),
        ({"sdpo_form": "sampled", "sdpo_temperature": 2.0}, "sdpo_temperature"),
    ],
)
def test_config_rejects_bad_options(overrides, match, tmp_path, h):
    with pytest.raises(ValueError, match=match):
        h.grpo_args(tmp_path, **overrides)


def test_a_plain_grpo_config_is_taken_with_the_channels_off(tmp_path, model_dir, tokenizer, dataset, h):
    """Swapping the trainer class alone: TRL's GRPOConfig, as TRL's __post_init__ left it, channels off."""
    from composer_trl import ComposerGRPOConfig

    plain = h.grpo_args(tmp_path, composer=False, loss_type="sapo", sapo_temperature_neg=2.0)
    trainer = h.make_trainer(model_dir, tokenizer, dataset, plain)
    assert isinstance(trainer.args, ComposerGRPOConfig)
    assert trainer.args.alpha_sdpo == trainer.args.beta_replay == 0.0
    assert trainer.args.steps_per_generation == plain.steps_per_generation
    assert trainer.args.compose_config.policy.sapo_temperature_neg == 2.0
    with pytest.raises(ValueError, match="GRPOConfig or ComposerGRPOConfig"):
        h.make_trainer(model_dir, tokenizer, dataset, {"learning_rate": 1e-3})


def test_no_args_builds_the_default_config_as_trl_does(tmp_path, monkeypatch, model_dir, dataset):
    from composer_core.tasks.digit_reversal import reverse_reward
    from composer_trl import ComposerGRPOConfig, ComposerGRPOTrainer

    monkeypatch.chdir(tmp_path)
    # TRL's default GRPOConfig has bf16=True, which TrainingArguments refuses on a machine without a bf16 GPU
    # (GRPOTrainer without args fails the same way here): stand in for such a GPU's check
    monkeypatch.setattr("transformers.training_args.is_torch_bf16_gpu_available", lambda: True)
    trainer = ComposerGRPOTrainer(model=str(model_dir), reward_funcs=reverse_reward, train_dataset=dataset)
    assert isinstance(trainer.args, ComposerGRPOConfig)
    assert trainer.args.output_dir.endswith(f"{model_dir.name}-GRPO")
    assert trainer.args.alpha_sdpo == trainer.args.beta_replay == 0.0


def test_sdpo_without_hints_is_an_error(tmp_path, model_dir, tokenizer, dataset, h):
    with pytest.raises(ValueError, match=r"alpha_sdpo=1\.0 needs hints"):
        h.make_trainer(model_dir, tokenizer, dataset, h.grpo_args(tmp_path))


def test_replay_without_pairs_is_an_error(tmp_path, model_dir, tokenizer, dataset, h):
    prompts_only = dataset.remove_columns(["chosen", "rejected"])
    with pytest.raises(ValueError, match="chosen"):
        h.make_trainer(model_dir, tokenizer, prompts_only, h.grpo_args(tmp_path, alpha_sdpo=0.0))


def test_column_reference_without_columns_is_an_error(tmp_path, model_dir, tokenizer, dataset, h):
    args = h.grpo_args(tmp_path, alpha_sdpo=0.0, replay_reference="column")
    with pytest.raises(ValueError, match="ref_chosen_logps"):
        h.make_trainer(model_dir, tokenizer, dataset, args)


def test_bad_pair_rows_raise(tmp_path, model_dir, tokenizer, dataset, h):
    ds = dataset.map(lambda r: {"chosen_mask": [0, 0, 0]})
    ds = ds.map(lambda r: {"chosen": [4, 5, 6]})
    trainer = h.make_trainer(
        model_dir, tokenizer, ds, h.grpo_args(tmp_path, alpha_sdpo=0.0, dpo_variant="simpo")
    )
    trainer.model.train()
    with pytest.raises(ValueError, match="no scored token"):
        trainer._generate_and_score_completions(h.generation_batch(ds, 2, 4))


def test_hint_fn_must_return_one_hint_per_completion(tmp_path, model_dir, tokenizer, dataset, h):
    trainer = h.make_trainer(
        model_dir, tokenizer, dataset, h.grpo_args(tmp_path, beta_replay=0.0), hint_fn=lambda **kw: ["1|"]
    )
    trainer.model.train()
    with pytest.raises(ValueError, match="hint_fn returned 1 hints for 8"):
        trainer._generate_and_score_completions(h.generation_batch(dataset, 2, 4))


def test_extra_columns_survive_remove_unused_columns(tmp_path, model_dir, tokenizer, dataset, h):
    """With remove_unused_columns=True TRL keeps only its signature columns; composer's are added to them."""
    ds = dataset.add_column("hint", ["5|"] * len(dataset)).add_column("unrelated", [0] * len(dataset))
    args = h.grpo_args(tmp_path, remove_unused_columns=True, max_steps=1)
    trainer = h.make_trainer(model_dir, tokenizer, ds, args)
    batch = next(iter(trainer.get_train_dataloader()))
    assert {"prompt", "hint", "chosen", "rejected"} <= set(batch[0])
    assert "unrelated" not in batch[0]
    trainer.train()
    logs = [r for r in trainer.state.log_history if "reward" in r]
    assert logs[0]["composer/loss/sdpo"] > 0 and logs[0]["composer/loss/replay"] > 0


def test_hint_placement_for_text_and_chat_prompts(tmp_path, model_dir, tokenizer, dataset, h):
    trainer = h.make_trainer(
        model_dir, tokenizer, dataset.add_column("hint", ["1|"] * len(dataset)), h.grpo_args(tmp_path)
    )
    assert trainer._apply_hint("381>", ".8.|") == ".8.|381>"  # hint_template "{hint}{prompt}"
    chat = [{"role": "system", "content": "s"}, {"role": "user", "content": "381>"}]
    hinted = trainer._apply_hint(chat, "expected 183")
    assert hinted[0] == chat[0] and hinted[1]["content"] == "381>\n\nexpected 183"
    assert chat[1]["content"] == "381>"  # the dataset row is not mutated
    with pytest.raises(ValueError, match="user message"):
        trainer._apply_hint([{"role": "system", "content": "s"}], "x")


def test_defaults_come_from_composer_core_and_the_core_config_is_built(tmp_path, h):
    import dataclasses

    from composer_core.loss.config import ComposeConfig, flat_defaults
    from composer_trl import ComposerGRPOConfig

    core = flat_defaults()
    shared = {f.name for f in dataclasses.fields(ComposerGRPOConfig)} & set(core)
    shared -= {
        "sdpo_form",
        "loss_type",
        "delta",
        "max_completion_length",
        "alpha_sdpo",
        "beta_replay",
    }  # TRL's own fields / adapter choice (a plain swap is plain GRPO: channels off)
    assert ComposerGRPOConfig.alpha_sdpo == ComposerGRPOConfig.beta_replay == 0.0
    assert {"simpo_gamma", "dpo_beta", "sdpo_token_clip", "taid_t_start"} <= shared
    for f in dataclasses.fields(ComposerGRPOConfig):
        if f.name in shared:
            assert f.default == core[f.name], f.name
    args = h.grpo_args(tmp_path, dpo_variant="simpo", simpo_gamma=0.2, sdpo_beta=0.3)
    cfg = args.compose_config
    assert isinstance(cfg, ComposeConfig) and cfg.replay.gamma == 0.2 and cfg.sdpo.beta == 0.3
    assert args.compose_config is cfg  # cached: the per-step read is a lookup
