"""ComposerGRPOTrainer's SDPO against TRL 1.16's own ``trl.experimental.sdpo.SDPOTrainer``, side by side.

Both trainers are built on the same saved tiny Qwen2, seed and dataset, with matching options; generation is
replaced in both by one deterministic function (one completion in four is the correct reversal), so the two see
the same rollouts and rewards and everything after generation is each trainer's own code:

- the teacher's input ids (reprompt ⊕ completion) equal token for token on every distilled row;
- the self-distillation mask equal;
- the per-step distillation loss equal (full logits; the sampled form's *value* differs by design, see below);
- the gradients equal over 3 optimiser steps, and the student's and the EMA teacher's weights after them.

Weight mapping (direct): TRL blends ``(1 − w)·policy + w·distill``, composer ``w_policy·policy + α·sdpo``, so
``w_policy = 1 − distillation_weight`` and ``alpha_sdpo = distillation_weight`` at the same learning rate; TRL's
default ``distillation_weight = 1`` (pure self-distillation) is ``w_policy = 0``, which computes no policy term.

Off-policy steps (``num_iterations = 2``, or ``steps_per_generation = 2`` with no gradient accumulation): both
trainers keep the rollout's log-probs and SDPOTrainer multiplies the distillation loss of every form by its clipped
importance ratio ``min(exp(ℓθ − ℓold), distillation_is_clip)``; composer's ``sdpo_token_clip`` does the same in
core, on every form. With ``steps_per_generation = 2`` GRPOTrainer shuffles the generation batch before splitting it
into micro-batches (SDPOTrainer does not; README, "Differences inherited from GRPOTrainer"): the run switches TRL's
shuffle off on composer's side so both see the same micro-batches, and ``test_grpo_shuffles_micro_batches`` shows
the shuffle.

Deliberate difference (asserted): in the sampled-token form TRL's loss value is the REINFORCE surrogate
``sg(ℓS − ℓT)·ℓS`` while composer reports the k1 estimate ``ℓS − ℓT`` of KL(student‖teacher); the gradients are
the same.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

pytest.importorskip("trl.experimental.sdpo")

G = 4
STEPS = 3
LR = 0.05
W = 0.5  # TRL distillation_weight; composer w_policy = 1 - W, alpha_sdpo = W
CLIP = 1.001  # tight: one SGD step moves the sampled tokens' ratios by ~1e-2, so this clip binds off-policy

# TRL's default templates, written with this character tokenizer's alphabet (digits, '>', '|', '.')
REPROMPT = "{prompt}|{solution}{feedback}.."
TRL_SOLUTION = ">{successful_previous_attempt}|"
COMPOSER_SOLUTION = ">{demonstration}|"


def _fake_generate(tokenizer: Any) -> Any:
    """model.generate → each prompt ⊕ a fixed completion: the reversal for row i % G == 0, else '000'."""
    eos = tokenizer.eos_token_id

    def generate(
        self: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, **_: Any
    ) -> Any:
        rows = []
        for i, ids in enumerate(input_ids.tolist()):
            text = tokenizer.decode([t for t in ids if t != tokenizer.pad_token_id], skip_special_tokens=True)
            digits = text.rstrip(">")
            answer = digits[::-1] if i % G == 0 else "0" * len(digits)
            rows.append(tokenizer(text=answer, add_special_tokens=False)["input_ids"] + [eos])
        width = max(len(r) for r in rows)
        comp = torch.tensor(
            [r + [tokenizer.pad_token_id] * (width - len(r)) for r in rows], device=input_ids.device
        )
        return torch.cat([input_ids, comp], dim=1)

    return generate


def exact_reward(prompts: list[str], completions: list[str], **_: Any) -> list[float]:
    return [1.0 if c == p.rstrip(">")[::-1] else 0.0 for p, c in zip(prompts, completions, strict=True)]


def _common(tmp_path: Any, name: str) -> dict[str, Any]:
    return {
        "output_dir": str(tmp_path / name),
        "per_device_train_batch_size": 8,
        "num_generations": G,
        "max_completion_length": 4,
        "max_steps": STEPS,
        "optim": "sgd",
        "max_grad_norm": 0.0,
        "lr_scheduler_type": "constant",
        "report_to": "none",
        "use_cpu": True,
        "save_strategy": "no",
        "disable_tqdm": True,
        "logging_steps": 1,
        "seed": 0,
        "loss_type": "dapo",
        "beta": 0.0,
        "shuffle_dataset": False,
        "bf16": False,
    }


class _Recorder:
    def __init__(self) -> None:
        self.teacher_prompts: list[list[list[int]]] = []
        self.masks: list[list[bool]] = []
        self.losses: list[float] = []
        self.grads: list[dict[str, torch.Tensor]] = []


def _grad_hook(trainer: Any, rec: _Recorder) -> None:
    from transformers import TrainerCallback

    class Grads(TrainerCallback):
        def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            rec.grads.append(
                {
                    n: p.grad.detach().clone()
                    for n, p in trainer.model.named_parameters()
                    if p.grad is not None
                }
            )

    trainer.add_callback(Grads())


def _strip(ids: torch.Tensor, mask: torch.Tensor) -> list[int]:
    return ids[mask.bool()].tolist()


def _run_trl(
    model_dir: Any,
    tokenizer: Any,
    dataset: Any,
    tmp_path: Any,
    mode: str,
    teacher: str,
    tail: bool = False,
    w: float = W,
    **extra: Any,
) -> Any:
    from transformers import AutoModelForCausalLM, TrainerCallback
    from trl.experimental.sdpo import SDPOConfig, SDPOTrainer

    rec = _Recorder()
    args = SDPOConfig(
        **_common(tmp_path, "trl"),
        learning_rate=LR,
        distillation_weight=w,
        distillation_mode=mode,
        distillation_alpha=1.0 if mode == "sampled_token" else 0.5,
        distillation_is_clip=CLIP,
        **({"distillation_topk": 5, "distillation_add_tail": tail} if mode == "topk_logits" else {}),
        teacher_model_kind=teacher,
        teacher_update_rate=0.5,
        teacher_sync_steps=1,
        use_successful_as_teacher=True,
        success_reward_threshold=1.0,
        dont_reprompt_on_self_success=True,
        reprompt_template=REPROMPT,
        solution_template=TRL_SOLUTION,
        max_reprompt_len=64,
        **extra,
    )
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    trainer = SDPOTrainer(
        model=model, reward_funcs=[exact_reward], args=args, train_dataset=dataset, processing_class=tokenizer
    )

    class Contexts(TrainerCallback):
        def on_teacher_context_built(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            mask = kw["self_distillation_mask"].bool().tolist()
            width = kw["teacher_input_ids"].shape[1] - kw["completion_mask"].shape[1]
            ids, att = kw["teacher_input_ids"][:, :width], kw["teacher_attention_mask"][:, :width]
            rec.teacher_prompts.append([_strip(i, a) if m else [] for i, a, m in zip(ids, att, mask)])
            rec.masks.append(mask)

    trainer.add_callback(Contexts())
    _grad_hook(trainer, rec)
    original = trainer._compute_self_distillation_loss

    def record(*a: Any, **k: Any) -> Any:
        loss = original(*a, **k)
        rec.losses.append(float(loss.detach()))
        return loss

    trainer._compute_self_distillation_loss = record  # type: ignore[method-assign]
    trainer.train()
    return trainer, rec


def _run_composer(
    model_dir: Any,
    tokenizer: Any,
    dataset: Any,
    tmp_path: Any,
    mode: str,
    teacher: str,
    tail: bool = False,
    w: float = W,
    **extra: Any,
) -> Any:
    import composer_trl.trainer as trainer_module
    from composer_trl import ComposerGRPOConfig, ComposerGRPOTrainer
    from transformers import AutoModelForCausalLM

    rec = _Recorder()
    args = ComposerGRPOConfig(
        **_common(tmp_path, "composer"),
        learning_rate=LR,
        w_policy=1 - w,
        alpha_sdpo=w,
        sdpo_token_clip=CLIP,
        beta_replay=0.0,
        sdpo_form={"sampled_token": "sampled", "full_logits": "full", "topk_logits": "topk"}[mode],
        **({"sdpo_topk": 5, "sdpo_topk_tail": tail} if mode == "topk_logits" else {}),
        sdpo_beta=0.5,
        sdpo_loss_agg="seq_mean",
        sdpo_teacher_context="success",
        success_reward_threshold=1.0,
        dont_reprompt_on_self_success=True,
        reprompt_template=REPROMPT,
        solution_template=COMPOSER_SOLUTION,
        max_reprompt_len=64,
        sdpo_teacher=teacher,
        **({"teacher_update_rate": 0.5} if teacher == "ema" else {}),
        **extra,
    )
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    trainer = ComposerGRPOTrainer(
        model=model, reward_funcs=[exact_reward], args=args, train_dataset=dataset, processing_class=tokenizer
    )
    build = trainer._build_group_contexts

    def contexts(*a: Any, **k: Any) -> Any:
        out = build(*a, **k)
        mask = out["composer_has_hint"].tolist()
        ids, att = out["composer_hint_ids"], out["composer_hint_mask"]
        rec.teacher_prompts.append([_strip(i, m) if h else [] for i, m, h in zip(ids, att, mask)])
        rec.masks.append(mask)
        return out

    trainer._build_group_contexts = contexts  # type: ignore[method-assign]
    _grad_hook(trainer, rec)
    original = trainer_module.composer_trl_loss

    def loss(*a: Any, **k: Any) -> Any:
        total, result = original(*a, **k)
        rec.losses.append(float(result.sdpo.detach()) if result.sdpo is not None else 0.0)
        return total, result

    trainer_module.composer_trl_loss = loss
    try:
        trainer.train()
    finally:
        trainer_module.composer_trl_loss = original
    return trainer, rec


def _compare(
    model_dir: Any,
    tokenizer: Any,
    dataset: Any,
    tmp_path: Any,
    mode: str,
    teacher: str,
    tail: bool,
    **kw: Any,
) -> None:
    trl_trainer, trl = _run_trl(model_dir, tokenizer, dataset, tmp_path, mode, teacher, tail, **kw)
    cmp_trainer, cmp = _run_composer(model_dir, tokenizer, dataset, tmp_path, mode, teacher, tail, **kw)

    per_generation = kw.get("num_iterations", 1) * kw.get("steps_per_generation", 1)
    rows = 8 * kw.get("steps_per_generation", 1)  # rows per generation batch
    generations = -(-STEPS // per_generation)
    assert len(trl.masks) == len(cmp.masks) == generations
    assert trl.masks == cmp.masks  # self-distillation mask, row for row
    assert sum(map(sum, cmp.masks)) == generations * rows // G * (
        G - 1
    )  # every failed row has a successful sibling
    assert trl.teacher_prompts == cmp.teacher_prompts  # reprompt token ids, token for token
    assert len(trl.grads) == len(cmp.grads) == STEPS
    for step, (g_trl, g_cmp) in enumerate(zip(trl.grads, cmp.grads)):
        assert g_trl.keys() == g_cmp.keys()
        for name in g_trl:
            torch.testing.assert_close(
                g_cmp[name], g_trl[name], rtol=2e-4, atol=1e-6, msg=f"step {step}: d/d {name}"
            )
    if mode != "sampled_token":
        torch.testing.assert_close(torch.tensor(cmp.losses), torch.tensor(trl.losses), rtol=1e-5, atol=1e-7)
    else:  # composer reports ℓS − ℓT (k1 KL estimate), TRL sg(ℓS − ℓT)·ℓS: different numbers, same gradient
        assert not torch.allclose(torch.tensor(cmp.losses), torch.tensor(trl.losses))
    for (n, p_t), (_, p_c) in zip(trl_trainer.model.named_parameters(), cmp_trainer.model.named_parameters()):
        torch.testing.assert_close(p_c, p_t, rtol=1e-4, atol=1e-6, msg=f"student {n}")
    if teacher in ("ema", "base"):
        t_trl = trl_trainer.accelerator.unwrap_model(trl_trainer.teacher_model)
        t_cmp = cmp_trainer.accelerator.unwrap_model(cmp_trainer._sdpo_teacher)
        moved = 0.0
        initial = dict(type(t_trl).from_pretrained(model_dir).named_parameters())
        for (n, p_t), (_, p_c) in zip(t_trl.named_parameters(), t_cmp.named_parameters()):
            torch.testing.assert_close(p_c, p_t, rtol=1e-4, atol=1e-6, msg=f"teacher {n}")
            moved = max(moved, float((p_t - initial[n]).abs().max()))
        assert (moved > 1e-4) == (teacher == "ema")  # the EMA teacher moved, the base teacher did not


@pytest.mark.parametrize(
    ("mode", "teacher", "tail", "w"),
    [
        ("full_logits", "ema", False, W),
        ("sampled_token", "ema", False, W),
        ("topk_logits", "ema", False, W),
        ("topk_logits", "live", True, W),
        ("full_logits", "base", False, W),
        ("sampled_token", "live", False, W),
        # TRL's default distillation_weight=1: composer's w_policy=0 (no policy term computed)
        ("full_logits", "ema", False, 1.0),
        ("sampled_token", "ema", False, 1.0),
    ],
)
def test_composer_sdpo_equals_trl_sdpo_trainer(
    mode, teacher, tail, w, model_dir, tokenizer, dataset, tmp_path, monkeypatch
):
    from transformers import Qwen2ForCausalLM

    monkeypatch.setattr(Qwen2ForCausalLM, "generate", _fake_generate(tokenizer))
    _compare(model_dir, tokenizer, dataset, tmp_path, mode, teacher, tail, w=w)


FORMS = [("full_logits", False), ("topk_logits", True), ("topk_logits", False), ("sampled_token", False)]


@pytest.mark.parametrize(("mode", "tail"), FORMS)
@pytest.mark.parametrize(
    "regime",
    [
        {
            "num_iterations": 2,
            "w": W,
        },  # the policy term in: GRPO's clip and SDPO's IS clip on the reused batch
        {"steps_per_generation": 2, "w": 1.0},  # two micro-batches (two optimiser steps) per generation
    ],
    ids=["num_iterations=2", "steps_per_generation=2"],
)
def test_is_clip_off_policy_equals_trl_sdpo_trainer(
    mode, tail, regime, model_dir, tokenizer, dataset, tmp_path, monkeypatch
):
    """SDPOTrainer's ``distillation_is_clip`` on every form == composer's ``sdpo_token_clip`` (core, every form)."""
    import trl.trainer.grpo_trainer as grpo_module
    from transformers import Qwen2ForCausalLM

    monkeypatch.setattr(Qwen2ForCausalLM, "generate", _fake_generate(tokenizer))
    monkeypatch.setattr(
        grpo_module, "shuffle_sequence_dict", lambda batch: batch
    )  # SDPOTrainer does not shuffle
    clipped: list[bool] = []  # the clip must bind: whether any weight hit it
    import composer_core.loss.channels as compose_module  # where compose_loss reads it

    weight = compose_module.is_clip_weight

    def spy(*a: Any) -> Any:
        w = weight(*a)
        if w is not None:
            clipped.append(bool((w == CLIP).any()))
        return w

    monkeypatch.setattr(compose_module, "is_clip_weight", spy)
    _compare(model_dir, tokenizer, dataset, tmp_path, mode, "ema", tail, **regime)
    assert any(clipped)  # the off-policy steps hit the clip: the test would see a missing clip


def test_w_policy_zero_skips_the_policy_terms_compute(
    model_dir, tokenizer, dataset, tmp_path, monkeypatch, h
):
    """w_policy=0 (TRL's distillation_weight=1) trains without computing the policy term: core's policy_loss and
    the surrogate's entropy/off-policy masks are never called, and its kl/clip_ratio metrics are not logged (the
    student's forward runs: channel 2 needs its hidden states)."""
    import composer_core.loss.compose as compose_module
    from composer_trl import ComposerGRPOTrainer

    def boom(*a: Any, **k: Any) -> None:
        raise AssertionError("the policy term was computed under w_policy=0")

    monkeypatch.setattr(compose_module, "policy_loss", boom)
    monkeypatch.setattr(ComposerGRPOTrainer, "_surrogate_masks", boom)
    args = h.grpo_args(
        tmp_path, w_policy=0.0, alpha_sdpo=1.0, beta_replay=0.0, sdpo_teacher_context="success",
        success_reward_threshold=0.3, max_steps=2,
    )  # fmt: skip
    trainer = h.make_trainer(model_dir, tokenizer, dataset, args)
    start = [p.detach().clone() for p in trainer.model.parameters()]
    trainer.train()
    logged = [r for r in trainer.state.log_history if "loss" in r]
    assert len(logged) == 2 and all("entropy" in r for r in logged)
    assert not any(k == "kl" or k.startswith("clip_ratio") for r in logged for k in r)
    assert any(r["composer/sdpo/tokens"] > 0 for r in logged)  # something was distilled
    assert any(not torch.equal(a, b) for a, b in zip(start, trainer.model.parameters()))  # and it trained
