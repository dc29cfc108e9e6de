"""SDPO's teacher context from the group and the teacher's weights in ComposerGRPOTrainer and composer-train.

The side-by-side equality with TRL's SDPOTrainer is test_sdpo_trainer_equivalence.py; the kill-and-resume of
the EMA teacher is test_lifecycle.py.
"""

from __future__ import annotations

import json
import logging

import pytest
import torch
from composer_core.sdpo import build_teacher_contexts
from composer_testkit.teacher_context import check_teacher_context
from composer_trl import ComposerGRPOConfig
from composer_trl.cli import main
from composer_trl.lifecycle import EXIT_USAGE
from composer_trl.progress import read_jsonl

from .conftest import grpo_args, make_trainer


def test_group_context_conformance_through_the_trainer_config(tmp_path):
    """The core conformance case, through composer-trl's path: options → ComposerGRPOConfig fields → contexts."""

    def build(prompts, completions, rewards, group_size, feedback, options):
        fields = {name: getattr(options, name) for name in options.__dataclass_fields__}
        args = ComposerGRPOConfig(
            output_dir=str(tmp_path), use_cpu=True, report_to="none", alpha_sdpo=1.0, **fields
        )
        ctx = build_teacher_contexts(  # as the trainer builds them from its config
            prompts,
            completions,
            rewards,
            group_size,
            args.teacher_context_options,
            feedback=feedback,
            seed=args.seed,
        )
        return ctx.contexts, ctx.mask

    assert len(check_teacher_context(build)) == 5


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        (
            {"sdpo_teacher_context": "success", "reprompt_template": "{prompt}{answer}"},
            r"unknown placeholder.*\{answer\}",
        ),
        ({"solution_template": "x{demonstration}"}, "only act.*sdpo_teacher_context='success'"),
        ({"sdpo_teacher": "teacher"}, "`sdpo_teacher`='teacher' is not supported"),
        ({"teacher_update_rate": 0.1}, "act only with sdpo_teacher='ema'"),
        ({"sdpo_teacher": "ema", "teacher_update_rate": 0.0}, r"must lie in \(0, 1\]"),
        ({"alpha_sdpo": 0.0, "sdpo_teacher": "ema"}, "act only with channel 2 on"),
        ({"sdpo_teacher_context": "success", "max_reprompt_len": 0}, "max_reprompt_len"),
    ],
)
def test_bad_options_raise_at_construction_naming_the_option(tmp_path, overrides, match):
    with pytest.raises(ValueError, match=match):
        ComposerGRPOConfig(output_dir=str(tmp_path), use_cpu=True, report_to="none", **overrides)


def test_success_context_trains_without_hints_and_masks_rows_without_a_success(
    tmp_path, model_dir, tokenizer, dataset
):
    """No hint column, no hint_fn: rows with a successful sibling are distilled, the others are not."""
    from transformers import AutoModelForCausalLM

    args = grpo_args(
        tmp_path,
        alpha_sdpo=1.0,
        beta_replay=0.0,
        sdpo_teacher_context="success",
        success_reward_threshold=0.3,
    )
    trainer = make_trainer(
        AutoModelForCausalLM.from_pretrained(model_dir),
        tokenizer,
        dataset.remove_columns(["chosen", "rejected"]),
        args,
    )
    seen: list[tuple[list[bool], list[float]]] = []
    build = trainer._build_group_contexts

    def record(inputs, output, mode):
        out = build(inputs, output, mode)
        seen.append((out["composer_has_hint"].tolist(), trainer._group_rewards()))
        return out

    trainer._build_group_contexts = record
    trainer.train()
    assert seen
    for mask, rewards in seen:
        for g in range(0, len(rewards), 4):
            group = rewards[g : g + 4]
            for i in range(4):
                others = [r >= 0.3 for j, r in enumerate(group) if j != i]
                assert mask[g + i] == any(others)
    logged = [m for m in trainer.state.log_history if "composer/loss/sdpo" in m]
    fractions = [
        m["composer/sdpo/success_group_fraction"]
        for m in trainer.state.log_history
        if "composer/sdpo/success_group_fraction" in m
    ]
    assert len(fractions) == len(logged)
    for row, frac in zip(logged, fractions):
        assert (row["composer/loss/sdpo"] != 0) == (frac > 0)


def test_hint_fn_with_success_only_context_raises(tmp_path, model_dir, tokenizer, dataset):
    from composer_core.tasks.digit_reversal import reverse_hints
    from transformers import AutoModelForCausalLM

    args = grpo_args(tmp_path, beta_replay=0.0, sdpo_teacher_context="success")
    with pytest.raises(ValueError, match="hint_fn` is not read with sdpo_teacher_context='success'"):
        make_trainer(
            AutoModelForCausalLM.from_pretrained(model_dir), tokenizer, dataset, args, hint_fn=reverse_hints
        )


def test_feedback_context_needs_a_feedback_source(tmp_path, model_dir, tokenizer, dataset):
    from transformers import AutoModelForCausalLM

    args = grpo_args(tmp_path, beta_replay=0.0, sdpo_teacher_context="success+feedback")
    with pytest.raises(ValueError, match="needs the environment's feedback"):
        make_trainer(AutoModelForCausalLM.from_pretrained(model_dir), tokenizer, dataset, args)


def test_unreachable_threshold_warns_once_with_the_group_count(
    tmp_path, model_dir, tokenizer, dataset, caplog
):
    from transformers import AutoModelForCausalLM

    args = grpo_args(
        tmp_path, beta_replay=0.0, sdpo_teacher_context="success", success_reward_threshold=5.0, max_steps=3
    )
    trainer = make_trainer(AutoModelForCausalLM.from_pretrained(model_dir), tokenizer, dataset, args)
    caplog.set_level(logging.WARNING, logger="composer_trl.teacher")
    trainer.train()
    warnings = [r.getMessage() for r in caplog.records if "success_reward_threshold=5.0" in r.getMessage()]
    assert len(warnings) == 1 and "none of the 2 groups" in warnings[0]


def test_base_teacher_is_the_frozen_initial_model(tmp_path, model_dir, tokenizer, dataset):
    from transformers import AutoModelForCausalLM

    args = grpo_args(
        tmp_path,
        beta_replay=0.0,
        sdpo_teacher_context="success",
        success_reward_threshold=0.3,
        sdpo_teacher="base",
    )
    trainer = make_trainer(AutoModelForCausalLM.from_pretrained(model_dir), tokenizer, dataset, args)
    initial = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    teacher = dict(trainer._sdpo_teacher.named_parameters())
    assert all(torch.equal(teacher[n], initial[n]) for n in initial)
    assert any(not torch.equal(p, initial[n]) for n, p in trainer.model.named_parameters())
    assert not any(p.requires_grad for p in teacher.values())


def test_peft_ema_teacher_is_an_ema_of_the_adapter_only(tmp_path, model_dir, tokenizer, dataset):
    """PEFT + ema: a frozen second adapter, started as a copy of the student's, follows the closed-form EMA of the
    student's adapter after every step; the base weights stay untouched and the teacher gets no gradient."""
    from composer_trl.teacher import TEACHER_ADAPTER
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, TrainerCallback

    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(model_dir), lora)
    base_before = {n: p.detach().clone() for n, p in model.named_parameters() if "lora_" not in n}
    args = grpo_args(
        tmp_path, beta_replay=0.0, sdpo_teacher_context="success", success_reward_threshold=0.3,
        sdpo_teacher="ema", teacher_update_rate=0.5, max_steps=3,
    )  # fmt: skip
    trainer = make_trainer(model, tokenizer, dataset, args)
    pairs = trainer._adapter_pairs()
    assert len(pairs) == 8 and all(not t.requires_grad for t, _ in pairs.values())
    expected = {n: s.detach().clone() for n, (_, s) in pairs.items()}  # the teacher starts as the student
    assert all(torch.equal(t, expected[n]) for n, (t, _) in pairs.items())

    class Closed(TrainerCallback):  # runs after composer's teacher callback (added later)
        def on_step_end(self, args, state, control, **kw):
            for n, (_, s) in trainer._adapter_pairs().items():
                expected[n] = expected[n] * (1 - 0.5) + s.detach() * 0.5

    trainer.add_callback(Closed())
    optimizer_params: list[torch.Tensor] = []

    class Opt(TrainerCallback):
        def on_train_begin(self, args, state, control, **kw):
            optimizer_params.extend(p for g in kw["optimizer"].param_groups for p in g["params"])

    trainer.add_callback(Opt())
    trainer.train()
    for n, (t, s) in trainer._adapter_pairs().items():
        torch.testing.assert_close(t, expected[n], rtol=1e-6, atol=1e-7, msg=n)
        assert not torch.equal(t, s)  # the teacher lags the student
    assert all(torch.equal(p, base_before[n]) for n, p in model.named_parameters() if "lora_" not in n)
    assert optimizer_params
    assert not any(
        TEACHER_ADAPTER in n for n, p in model.named_parameters() if any(p is q for q in optimizer_params)
    )
    assert any(m.get("composer/loss/sdpo", 0) > 0 for m in trainer.state.log_history)


def test_composer_train_ema_success_runs_embedded_task_with_sdpo_where_a_group_succeeded(tmp_path):
    out = tmp_path / "run"
    argv = ["--steps", "4", "--output_dir", str(out), "--no_plot", "--sdpo_teacher", "ema"]
    argv += ["--sdpo_teacher_context", "success", "--success_reward_threshold", "0.3"]
    assert main(argv) == 0
    rows = read_jsonl(out / "metrics-composer.jsonl")
    assert len(rows) == 4
    assert any(r["composer/sdpo/success_group_fraction"] > 0 for r in rows)
    for r in rows:
        assert (r["composer/loss/sdpo"] > 0) == (r["composer/sdpo/success_group_fraction"] > 0)


def test_composer_train_bad_template_is_one_line_exit_2_before_output(tmp_path, capsys):
    out = tmp_path / "run"
    argv = ["--steps", "2", "--output_dir", str(out), "--sdpo_teacher_context", "success"]
    assert main([*argv, "--reprompt_template", "{prompt}{oops}"]) == EXIT_USAGE
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "reprompt_template" in err[0] and "{oops}" in err[0]
    assert not out.exists() or not any(out.iterdir())


def test_channel_without_inputs_is_one_line_exit_2_before_the_model_loads(tmp_path, capsys, monkeypatch):
    """A dataset with only `prompt`, channel 2 set on with the hint context: one line, exit 2, no model loaded,
    nothing written (it used to load the model, print a 21-line traceback, exit 1 and leave trainer-composer/)."""
    import composer_trl.job as job

    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{i}{i}{i}>"}) + "\n" for i in range(10)))
    (tmp_path / "my_reward.py").write_text(
        "def f(completions, **kw):\n    return [0.0 for _ in completions]\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(job, "load_model", lambda *a, **k: pytest.fail("the model was loaded"))
    out = tmp_path / "run"
    argv = ["--dataset_name", str(data), "--reward_funcs", "my_reward:f", "--output_dir", str(out)]
    assert main([*argv, "--alpha_sdpo", "1", "--beta_replay", "0"]) == EXIT_USAGE
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "needs hints" in err[0] and "sdpo_teacher_context='success'" in err[0]
    assert main([*argv, "--sdpo_teacher_context", "success", "--beta_replay", "1"]) == EXIT_USAGE
    assert "needs `chosen` and `rejected`" in capsys.readouterr().err
    assert not out.exists() or not any(out.iterdir())
