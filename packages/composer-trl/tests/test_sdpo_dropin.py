"""``ComposerSDPOTrainer`` is a drop-in for TRL 1.16's ``trl.experimental.sdpo.SDPOTrainer``.

- its constructor has SDPOTrainer's signature (names, order, defaults) and positional construction equals keyword
  construction;
- every ``SDPOConfig`` field is read: changing any SDPO-only field from its default changes the composer options
  it maps to, or is one the trainer reads itself;
- handed the same ``SDPOConfig``, ``ComposerSDPOTrainer`` and ``SDPOTrainer`` fire the same callback events with
  equal tensors (teacher input ids, attention mask, completion mask, self-distillation mask) and compute equal
  gradients over 3 optimiser steps; generation is replaced in both by one deterministic function.
"""

from __future__ import annotations

import inspect
from typing import Any

import pytest
import torch

pytest.importorskip("trl.experimental.sdpo")

G = 4


def test_signature_is_sdpo_trainers() -> None:
    from composer_trl import ComposerSDPOTrainer
    from trl.experimental.sdpo import SDPOTrainer

    ours = inspect.signature(ComposerSDPOTrainer.__init__).parameters.values()
    theirs = inspect.signature(SDPOTrainer.__init__).parameters.values()
    assert [(p.name, p.kind, p.default) for p in ours] == [(p.name, p.kind, p.default) for p in theirs]


#: SDPO-only field -> (a non-default value, what the baseline needs for it to be valid)
CHANGED: dict[str, tuple[Any, dict[str, Any]]] = {
    "distillation_weight": (0.5, {}),
    "distillation_alpha": (0.5, {"distillation_mode": "full_logits"}),
    "distillation_mode": ("full_logits", {}),
    "distillation_topk": (4, {"distillation_mode": "topk_logits", "distillation_topk": 2}),
    "distillation_is_clip": (None, {}),
    "distillation_add_tail": (True, {"distillation_mode": "topk_logits", "distillation_topk": 2}),
    "teacher_model_kind": ("live", {}),
    "teacher_update_rate": (0.5, {}),
    "teacher_sync_steps": (3, {}),
    "max_reprompt_len": (7, {}),
    "use_successful_as_teacher": (False, {"include_environment_feedback": True}),
    "success_reward_threshold": (0.5, {}),
    "dont_reprompt_on_self_success": (False, {}),
    "reprompt_template": ("{prompt}{solution}{feedback}!", {}),
    "solution_template": ("<{successful_previous_attempt}>", {}),
    "feedback_template": ("<{feedback_raw}>", {"include_environment_feedback": True}),
    "include_environment_feedback": (True, {}),
    "environment_feedback_only_without_solution": (True, {"include_environment_feedback": True}),
    "remove_thinking_from_demonstration": (True, {}),
}
#: read by ComposerSDPOTrainer itself (tested in TRL's own file with the swap, tests/test_trl_upstream.py)
READ_BY_TRAINER = {
    "max_prompt_length",
    "use_teacher_server",
    "diagnostics_warning_interval",
    "diagnostics_flat_tolerance",
}


def test_every_sdpo_field_is_read(tmp_path: Any) -> None:
    import dataclasses

    from composer_trl.sdpo import grpo_config
    from trl import GRPOConfig
    from trl.experimental.sdpo import SDPOConfig

    own = {f.name for f in dataclasses.fields(SDPOConfig)} - {f.name for f in dataclasses.fields(GRPOConfig)}
    assert own == set(CHANGED) | READ_BY_TRAINER
    common = {"output_dir": str(tmp_path), "use_cpu": True, "report_to": "none"}

    def read(sdpo: dict[str, Any]) -> dict[str, Any]:
        """Every option composer's trainer reads for channels 1 and 2, by composer's names."""
        g = grpo_config(SDPOConfig(**common, **sdpo))
        teacher = {**vars(g.teacher_context_options), **vars(g.teacher_weights_options)}
        return {**g.compose_options(), **{f"teacher.{k}": v for k, v in teacher.items()}}

    for name, (value, base) in CHANGED.items():
        before, after = read(base), read({**base, name: value})
        assert before != after, f"SDPOConfig.{name}={value!r} changes no composer option"


def test_no_teacher_context_raises(tmp_path: Any) -> None:
    from composer_trl import ComposerSDPOConfig

    with pytest.raises(ValueError, match="use_successful_as_teacher=False"):
        ComposerSDPOConfig(output_dir=str(tmp_path), use_cpu=True, use_successful_as_teacher=False)


def _fake_generate(tokenizer: Any) -> Any:
    """model.generate → prompt ⊕ a fixed completion: the reversal for row i % G == 0, else zeros."""
    eos = tokenizer.eos_token_id

    def generate(self: Any, input_ids: torch.Tensor, attention_mask: Any = None, **_: Any) -> Any:
        rows = []
        for i, ids in enumerate(input_ids.tolist()):
            text = tokenizer.decode([t for t in ids if t != tokenizer.pad_token_id], skip_special_tokens=True)
            digits = text.rstrip(">")
            answer = digits[::-1] if i % G == 0 else "0" * len(digits)
            rows.append(tokenizer(text=answer, add_special_tokens=False)["input_ids"] + [eos])
        width = max(len(r) for r in rows)
        comp = [r + [tokenizer.pad_token_id] * (width - len(r)) for r in rows]
        return torch.cat([input_ids, torch.tensor(comp, device=input_ids.device)], dim=1)

    return generate


def exact_reward(prompts: list[str], completions: list[str], **_: Any) -> list[float]:
    return [1.0 if c == p.rstrip(">")[::-1] else 0.0 for p, c in zip(prompts, completions, strict=True)]


def _run(cls: Any, args: Any, model_dir: Any, tokenizer: Any, dataset: Any, positional: bool = False) -> Any:
    from transformers import AutoModelForCausalLM, TrainerCallback

    events: list[dict[str, Any]] = []
    grads: list[dict[str, torch.Tensor]] = []

    class Record(TrainerCallback):
        def on_teacher_context_built(self, **kw: Any) -> None:
            keys = (
                "teacher_input_ids",
                "teacher_attention_mask",
                "completion_mask",
                "self_distillation_mask",
            )
            events.append({k: kw[k].detach().clone() for k in keys})

        def on_self_distillation_batch_prepared(self, **kw: Any) -> None:
            events[-1]["prompt_ids"] = kw["prompt_ids"].clone()

        def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            grads.append({n: p.grad.clone() for n, p in kw["model"].named_parameters() if p.grad is not None})

    model = AutoModelForCausalLM.from_pretrained(model_dir)
    if positional:
        trainer = cls(model, [exact_reward], args, dataset, None, tokenizer, None, [Record()])
    else:
        trainer = cls(
            model=model,
            reward_funcs=[exact_reward],
            args=args,
            train_dataset=dataset,
            processing_class=tokenizer,
            callbacks=[Record()],
        )
    trainer.train()
    return trainer, events, grads


def _args(tmp_path: Any, name: str, **sdpo: Any) -> Any:
    from trl.experimental.sdpo import SDPOConfig

    return SDPOConfig(
        output_dir=str(tmp_path / name),
        per_device_train_batch_size=8,
        num_generations=G,
        max_completion_length=4,
        max_steps=3,
        learning_rate=0.05,
        optim="sgd",
        max_grad_norm=0.0,
        lr_scheduler_type="constant",
        report_to="none",
        use_cpu=True,
        bf16=False,
        save_strategy="no",
        disable_tqdm=True,
        seed=0,
        shuffle_dataset=False,
        teacher_update_rate=0.5,
        reprompt_template="{prompt}|{solution}{feedback}..",
        solution_template=">{successful_previous_attempt}|",
        max_reprompt_len=64,
        **sdpo,
    )


@pytest.mark.parametrize(
    "sdpo",
    [
        {},  # TRL's defaults: pure self-distillation (w=1), sampled token, EMA teacher, clip 2
        {"distillation_weight": 0.5, "distillation_mode": "full_logits", "distillation_alpha": 0.5},
        {"distillation_mode": "topk_logits", "distillation_topk": 5, "distillation_add_tail": True},
    ],
    ids=["defaults", "full-w0.5", "topk-tail"],
)
def test_drop_in_equals_sdpo_trainer(sdpo, model_dir, tokenizer, dataset, tmp_path, monkeypatch) -> None:
    from composer_trl import ComposerSDPOTrainer
    from transformers import Qwen2ForCausalLM
    from trl.experimental.sdpo import SDPOTrainer

    monkeypatch.setattr(Qwen2ForCausalLM, "generate", _fake_generate(tokenizer))
    trl, trl_events, trl_grads = _run(
        SDPOTrainer, _args(tmp_path, "trl", **sdpo), model_dir, tokenizer, dataset
    )
    positional = not sdpo  # the defaults case builds composer's trainer positionally
    cmp, events, grads = _run(
        ComposerSDPOTrainer, _args(tmp_path, "cmp", **sdpo), model_dir, tokenizer, dataset, positional
    )
    assert len(events) == len(trl_events) == 3
    for step, (ours, theirs) in enumerate(zip(events, trl_events)):
        assert ours.keys() == theirs.keys()
        for key in theirs:
            assert torch.equal(ours[key], theirs[key].to(ours[key].dtype)), f"step {step}: {key}"
    assert sum(int(e["self_distillation_mask"].sum()) for e in events) == 3 * 8 // G * (G - 1)
    assert len(grads) == len(trl_grads) == 3
    for step, (ours_g, theirs_g) in enumerate(zip(grads, trl_grads)):
        assert ours_g.keys() == theirs_g.keys()
        for name in theirs_g:
            torch.testing.assert_close(
                ours_g[name], theirs_g[name], rtol=2e-4, atol=1e-6, msg=f"{step}: {name}"
            )
    for (n, p_t), (_, p_c) in zip(trl.model.named_parameters(), cmp.model.named_parameters()):
        torch.testing.assert_close(p_c, p_t, rtol=1e-4, atol=1e-6, msg=f"student {n}")
