"""`composer-train` does what TRL users expect around the loss (issue 52): LoRA through TRL's ``ModelConfig``
flags, ``--report_to tensorboard``, ``--eval_strategy``, a model card, and bf16 off on CPUs without it."""

from __future__ import annotations

import json

import pytest
import torch
from composer_trl.cli import main, parse
from composer_trl.progress import read_jsonl

FAST = ["--no_plot", "--max_completion_length", "3", "--per_device_train_batch_size", "8"]


def test_model_config_flags_are_parsed_with_trl_model_config():
    inv = parse(["--model", "org/m", "--use_peft", "--lora_r", "8", "--lora_alpha", "16"])
    assert inv.recipe.model == "org/m"  # --model is still the alias of --model_name_or_path
    assert inv.recipe.model_args == {"use_peft": True, "lora_r": 8, "lora_alpha": 16}
    assert "use_peft" not in inv.recipe.trainer  # ModelConfig fields are not trainer config fields
    inv = parse(
        ["--model_name_or_path", "org/m", "--lora_target_modules", "q_proj", "v_proj", "--dtype", "bfloat16"]
    )
    assert inv.recipe.model_args == {"lora_target_modules": ["q_proj", "v_proj"], "dtype": "bfloat16"}


def test_use_peft_trains_only_lora_weights_with_all_channels(tmp_path, model_dir):
    """The issue's whole line: LoRA, every channel, tensorboard and evaluation in one run."""
    from safetensors.torch import load_file

    out = tmp_path / "run"
    argv = ["--model", str(model_dir), "--steps", "3", "--output_dir", str(out), *FAST]
    argv += ["--learning_rate", "1e-2"]
    argv += ["--use_peft", "--lora_r", "8", "--lora_alpha", "16", "--lora_target_modules", "q_proj", "v_proj"]
    argv += ["--report_to", "tensorboard", "--eval_strategy", "steps", "--eval_steps", "3"]
    assert main(argv) == 0
    logged = read_jsonl(out / "metrics-composer.jsonl")
    rows = [r for r in logged if "reward" in r]
    assert len(rows) == 3
    for r in rows:
        assert r["composer/loss/sdpo"] > 0 and r["composer/replay/pairs"] > 0
    assert [r["step"] for r in logged if "eval_reward" in r] == [3]
    composer = {k for r in rows for k in r if k.startswith("composer/")}
    assert {f"train/{k}" for k in composer} <= set(_tensorboard(out).Tags()["scalars"])
    saved = out / "model"
    assert (saved / "adapter_config.json").is_file()
    assert not (saved / "model.safetensors").exists()  # the base is not written again: it did not move
    config = json.loads((saved / "adapter_config.json").read_text())
    assert config["r"] == 8 and config["lora_alpha"] == 16
    assert set(config["target_modules"]) == {"q_proj", "v_proj"}
    adapter = load_file(str(saved / "adapter_model.safetensors"))
    assert adapter and all("lora_" in name for name in adapter)
    assert any(t.abs().sum() > 0 for name, t in adapter.items() if "lora_B" in name)  # lora_B starts at 0

    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_dir)
    reference = {n: p.detach().clone() for n, p in base.state_dict().items()}
    merged = PeftModel.from_pretrained(base, saved)
    for name, p in merged.named_parameters():
        if "lora_" in name:
            continue
        plain = name.removeprefix("base_model.model.").replace(".base_layer.", ".")
        assert torch.equal(p, reference[plain]), name


def _tensorboard(out):
    """The run's tensorboard events, read back with tensorboard's own reader."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = sorted((out / "trainer-composer" / "runs").rglob("events.out.tfevents.*"))
    assert events
    acc = EventAccumulator(str(events[0].parent))
    acc.Reload()
    return acc


def test_report_to_tensorboard_writes_every_composer_metric(tmp_path):
    out = tmp_path / "run"
    assert main(["--steps", "2", "--output_dir", str(out), *FAST, "--report_to", "tensorboard"]) == 0
    acc = _tensorboard(out)
    tags = set(acc.Tags()["scalars"])
    logged = {k for r in read_jsonl(out / "metrics-composer.jsonl") for k in r if k.startswith("composer/")}
    assert logged and {"composer/loss/sdpo", "composer/loss/replay"} <= logged
    assert {f"train/{k}" for k in logged} <= tags
    assert len(acc.Scalars("train/composer/loss/sdpo")) == 2


def test_eval_strategy_evaluates_held_out_prompts(tmp_path):
    out = tmp_path / "run"
    argv = ["--steps", "2", "--output_dir", str(out), *FAST, "--eval_strategy", "steps", "--eval_steps", "2"]
    assert main(argv) == 0
    rows = read_jsonl(out / "metrics-composer.jsonl")
    evals = [r for r in rows if "eval_reward" in r]
    assert [r["step"] for r in evals] == [2]
    assert 0.0 <= evals[0]["eval_reward"] <= 1.0  # the digit-reversal verifier's score
    assert [r["step"] for r in rows if "reward" in r] == [1, 2]


def test_eval_holdout_on_a_user_dataset(tmp_path):
    from composer_core.tasks.digit_reversal import make_dataset_rows

    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in make_dataset_rows(40, seed=3)))
    out = tmp_path / "run"
    argv = ["--dataset_name", str(data), "--steps", "1", "--output_dir", str(out), *FAST]
    argv += ["--eval_strategy", "steps", "--eval_steps", "1", "--eval_holdout", "4"]
    assert main(argv) == 0
    assert any("eval_reward" in r for r in read_jsonl(out / "metrics-composer.jsonl"))


def test_saved_model_has_a_trl_model_card_naming_the_options(tmp_path):
    out = tmp_path / "run"
    argv = ["--steps", "1", "--output_dir", str(out), *FAST, "--alpha_sdpo", "0.5", "--dpo_variant", "dpo"]
    assert main(argv) == 0
    card = (out / "model" / "README.md").read_text()
    assert "generated_from_trainer" in card and "trl" in card and "composer" in card  # TRL's card writer
    for option in ("alpha_sdpo", "beta_replay", "sdpo_teacher_context", "sdpo_teacher", "dpo_variant"):
        assert option in card
    assert "| alpha_sdpo | 0.5 |" in card and "| dpo_variant | dpo |" in card


def _record_bf16(monkeypatch):
    from composer_trl import cli

    seen: list[bool] = []
    run = cli.Job.run

    def recording(self, **kw):
        seen.append(bool(self.config.bf16))
        return run(self, **kw)

    monkeypatch.setattr(cli.Job, "run", recording)
    return seen


@pytest.mark.parametrize("supported", [False, True])
def test_bf16_defaults_off_on_a_cpu_without_bf16(tmp_path, monkeypatch, capsys, supported):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: supported)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
    seen = _record_bf16(monkeypatch)
    assert main(["--steps", "1", "--output_dir", str(tmp_path / "a"), *FAST]) == 0
    line = "composer-train: this CPU has no bf16 support: bf16=False (pass --bf16 true to force)"
    err = capsys.readouterr().err
    if supported:
        assert seen == [True] and line not in err
    else:
        assert seen == [False] and err.count(line) == 1
        # an explicit --bf16 wins, with no line
        assert main(["--steps", "1", "--output_dir", str(tmp_path / "b"), *FAST, "--bf16", "true"]) == 0
        assert seen == [False, True] and line not in capsys.readouterr().err
