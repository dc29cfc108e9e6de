"""The three channels through the real TRL training loop and on fixed batches."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from composer_core import ADAPTER_PREFIX, GRAD_NORM_KEYS, METRIC_KEYS
from composer_core.tasks.digit_reversal import reverse_hints

# composer-core's metric keys under composer/, except policy/* (TRL logs its own kl / clip_ratio) and the
# TAID-only taid/t; composer-trl logs no extras of its own.
LOGGED_3_CHANNELS = {  # the grad_norm/* keys are opt-in (log_channel_grad_norms=False by default)
    ADAPTER_PREFIX + k
    for k in METRIC_KEYS
    if k not in GRAD_NORM_KEYS and not k.startswith(("policy/", "taid/"))
}


def _params(model: Any) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def test_trains_all_three_channels_and_logs_them(tmp_path, model_dir, tokenizer, dataset, h):
    args = h.grpo_args(tmp_path, max_steps=3, dpo_variant="dpo")
    trainer = h.make_trainer(model_dir, tokenizer, dataset, args, hint_fn=reverse_hints)
    before = _params(trainer.model)
    trainer.train()
    after = _params(trainer.model)
    assert any(not torch.equal(before[n], after[n]) for n in before)
    logs = [row for row in trainer.state.log_history if "reward" in row]
    assert len(logs) == 3
    for row in logs:
        for key in (
            "composer/loss/policy",
            "composer/loss/sdpo",
            "composer/loss/replay",
            "composer/loss/total",
        ):
            assert key in row
        assert row["composer/loss/sdpo"] > 0  # hints present on every step (no completion is right yet)
        assert row["composer/loss/replay"] > 0
        assert row["composer/sdpo/skipped"] == 0 and row["composer/replay/skipped"] == 0
        assert row["composer/replay/pairs"] == 2  # 8 completions = 2 prompts x 4: one pair per prompt
        assert row["composer/sdpo/tokens"] > 0
        assert {k for k in row if k.startswith("composer/")} == LOGGED_3_CHANNELS
    # channel 1 is logged with TRL's own names as well
    assert "clip_ratio/region_mean" in logs[0] and "entropy" in logs[0]


def test_policy_channel_is_nonzero_when_advantages_are(tmp_path, model_dir, tokenizer, dataset, h):
    trainer = h.make_trainer(
        model_dir, tokenizer, dataset, h.grpo_args(tmp_path, num_iterations=2), hint_fn=reverse_hints
    )
    trainer.current_gradient_accumulation_steps = 1
    trainer.model.train()
    torch.manual_seed(0)
    inputs = trainer._generate_and_score_completions(h.generation_batch(dataset, 2, 4))
    inputs["advantages"] = torch.linspace(-1.0, 1.0, 8)
    inputs["old_per_token_logps"] = inputs["old_per_token_logps"] - 0.1
    trainer.compute_loss(trainer.model, inputs)
    assert trainer._metrics["train"]["composer/loss/policy"][-1] != 0.0
    assert trainer._metrics["train"]["composer/loss/sdpo"][-1] > 0.0
    assert trainer._metrics["train"]["composer/loss/replay"][-1] > 0.0


@pytest.mark.parametrize("sdpo_beta", [0.0, 1.0, 0.5])
def test_sdpo_is_zero_when_hinted_context_equals_plain(sdpo_beta, tmp_path, model_dir, tokenizer, dataset, h):
    """Teacher = the same model on the same context: the divergence is exactly 0 for every beta.

    For 0 < beta < 1 core computes the mixture log-density around the larger log-prob, so identical
    distributions give log m == log p bitwise (a plain logsumexp would leave a ~1e-8 residue, as TRL's GKD does).
    """
    same = dataset.add_column("hinted_prompt", list(dataset["prompt"]))
    args = h.grpo_args(tmp_path, beta_replay=0.0, sdpo_beta=sdpo_beta)
    trainer = h.make_trainer(model_dir, tokenizer, same, args)
    trainer.current_gradient_accumulation_steps = 1
    trainer.model.train()
    torch.manual_seed(0)
    inputs = trainer._generate_and_score_completions(h.generation_batch(same, 2, 4))
    assert inputs["composer_has_hint"].all()
    assert torch.equal(inputs["composer_hint_ids"], inputs["prompt_ids"])
    trainer.compute_loss(trainer.model, inputs)
    value = trainer._metrics["train"]["composer/loss/sdpo"][-1]
    assert trainer._metrics["train"]["composer/sdpo/skipped"][-1] == 0  # computed, not skipped
    assert value == 0.0

    # ...and a real hint moves the teacher: the same batch with feedback hints gives a positive loss
    hinted = dataset.add_column("hint", ["9|"] * len(dataset))
    trainer2 = h.make_trainer(
        model_dir, tokenizer, hinted, h.grpo_args(tmp_path, beta_replay=0.0, sdpo_beta=sdpo_beta)
    )
    trainer2.current_gradient_accumulation_steps = 1
    trainer2.model.train()
    torch.manual_seed(0)
    inputs2 = trainer2._generate_and_score_completions(h.generation_batch(hinted, 2, 4))
    trainer2.compute_loss(trainer2.model, inputs2)
    assert trainer2._metrics["train"]["composer/loss/sdpo"][-1] > 1e-4


def test_sdpo_teacher_gets_no_gradient_and_student_does(tmp_path, model_dir, tokenizer, dataset, h):
    hinted = dataset.add_column("hint", ["123|"] * len(dataset))
    args = h.grpo_args(tmp_path, beta_replay=0.0)
    trainer = h.make_trainer(model_dir, tokenizer, hinted, args)
    trainer.current_gradient_accumulation_steps = 1
    trainer.model.train()
    torch.manual_seed(0)
    inputs = trainer._generate_and_score_completions(h.generation_batch(hinted, 2, 4))
    inputs["advantages"] = torch.zeros(8)  # channel 1 contributes no gradient: what remains is channel 2
    loss = trainer.compute_loss(trainer.model, inputs)
    loss.backward()
    grads = [p.grad for p in trainer.model.parameters()]
    assert all(g is not None for g in grads)
    assert sum(float(g.abs().sum()) for g in grads) > 0


@pytest.mark.parametrize("variant", ["dpo", "simpo"])
def test_replay_gradient_raises_chosen_over_rejected(variant, tmp_path, model_dir, tokenizer, dataset, h):
    args = h.grpo_args(tmp_path, alpha_sdpo=0.0, dpo_variant=variant)
    trainer = h.make_trainer(model_dir, tokenizer, dataset, args)
    trainer.current_gradient_accumulation_steps = 1
    trainer.model.train()
    torch.manual_seed(0)
    inputs = trainer._generate_and_score_completions(h.generation_batch(dataset, 2, 4))
    inputs["advantages"] = torch.zeros(8)  # isolate channel 3
    rows = inputs["composer_has_pair"].nonzero().squeeze(-1)
    assert rows.numel() == 2

    def margin() -> float:
        with torch.no_grad():
            c, r = trainer._pair_logps(trainer.model, inputs, inputs, rows)
        return float((c - r).sum())

    before = margin()
    opt = torch.optim.SGD(trainer.model.parameters(), lr=0.5)
    opt.zero_grad()
    trainer.compute_loss(trainer.model, inputs).backward()
    opt.step()
    assert margin() > before + 1e-3


def test_replay_reference_from_precomputed_columns(tmp_path, model_dir, tokenizer, dataset, h):
    n = len(dataset)
    ds = dataset.add_column("ref_chosen_logps", [-1.0] * n).add_column("ref_rejected_logps", [-2.0] * n)
    args = h.grpo_args(tmp_path, alpha_sdpo=0.0, dpo_variant="dpo")
    trainer = h.make_trainer(model_dir, tokenizer, ds, args)
    assert trainer._replay_ref_source == "column"
    trainer.model.train()
    inputs = trainer._generate_and_score_completions(h.generation_batch(ds, 2, 4))
    rows = inputs["composer_has_pair"]
    assert torch.equal(inputs["composer_ref_chosen_logps"][rows], torch.full((2,), -1.0))
    assert torch.equal(inputs["composer_ref_rejected_logps"][rows], torch.full((2,), -2.0))


def test_replay_reference_frozen_copy_matches_policy_at_start(tmp_path, model_dir, tokenizer, dataset, h):
    """With no TRL ref model (beta=0) DPO's reference is a frozen copy of the initial policy: at step 0 the
    DPO loss is ln 2 exactly as the closed form says (policy = reference)."""
    args = h.grpo_args(tmp_path, alpha_sdpo=0.0, dpo_variant="dpo")
    trainer = h.make_trainer(model_dir, tokenizer, dataset, args)
    assert trainer._replay_ref_source == "frozen_copy"
    trainer.current_gradient_accumulation_steps = 1
    trainer.model.train()
    inputs = trainer._generate_and_score_completions(h.generation_batch(dataset, 2, 4))
    trainer.compute_loss(trainer.model, inputs)
    assert trainer._metrics["train"]["composer/loss/replay"][-1] == pytest.approx(
        0.6931471805599453, abs=1e-6
    )


@pytest.mark.parametrize("loss_type", ["dapo", "grpo"])
def test_gradient_accumulation_invariance(loss_type, tmp_path, model_dir, tokenizer, dataset, h):
    """One batch of 8 in one micro-batch == the same 8 rows in two micro-batches of 4 (all channels on).

    Run in float32 (``bf16=False``): under CPU bf16 autocast (TRL's default) the batch split changes bf16
    rounding by ~0.2% — the same for plain GRPOTrainer — which would hide a normalisation error.
    """
    full = h.make_trainer(
        model_dir,
        tokenizer,
        dataset,
        h.grpo_args(tmp_path, loss_type=loss_type, num_iterations=2, bf16=False),
        hint_fn=reverse_hints,
    )
    acc = h.make_trainer(
        model_dir,
        tokenizer,
        dataset,
        h.grpo_args(
            tmp_path,
            loss_type=loss_type,
            num_iterations=2,
            per_device_train_batch_size=4,
            bf16=False,
            gradient_accumulation_steps=2,
        ),
        hint_fn=reverse_hints,
    )
    from trl.trainer.utils import split_tensor_dict

    full.model.train()
    acc.model.train()
    torch.manual_seed(0)
    inputs = full._generate_and_score_completions(h.generation_batch(dataset, 2, 4))
    inputs["advantages"] = torch.linspace(-1.0, 1.0, 8)
    inputs["old_per_token_logps"] = inputs["old_per_token_logps"] + 0.2 * torch.randn(8, 3)
    full.current_gradient_accumulation_steps = 1
    full.compute_loss(full.model, inputs).backward()
    acc.current_gradient_accumulation_steps = 2
    # keep one pair in each half, as TRL's shuffle would spread them
    perm = torch.tensor([0, 1, 2, 3, 4, 5, 6, 7])
    halves = split_tensor_dict(
        {k: (v[perm] if torch.is_tensor(v) and v.ndim > 0 else v) for k, v in inputs.items()}, 2
    )
    for half in halves:
        acc.compute_loss(acc.model, half).backward()
    sdpo_f = full._metrics["train"]["composer/loss/sdpo"][-1]
    assert sdpo_f > 0 and full._metrics["train"]["composer/loss/replay"][-1] > 0
    for (n, pf), (_, pa) in zip(full.model.named_parameters(), acc.model.named_parameters()):
        torch.testing.assert_close(pa.grad, pf.grad, atol=1e-6, rtol=1e-5, msg=n)
    # the logged channel values are contributions: the two micro-batches add up to the full batch's value
    # (outside TRL's accumulate() every call is its own logging window)
    for key in ("composer/loss/sdpo", "composer/loss/replay", "composer/loss/policy"):
        two = acc._metrics["train"][key][-2:]
        assert sum(two) == pytest.approx(full._metrics["train"][key][-1], rel=1e-5, abs=1e-6)


def test_sampled_form_and_taid_wrapper_train(tmp_path, model_dir, tokenizer, dataset, h):
    args = h.grpo_args(tmp_path, sdpo_form="sampled", beta_replay=0.0, max_steps=2)
    trainer = h.make_trainer(model_dir, tokenizer, dataset, args, hint_fn=reverse_hints)
    trainer.train()
    logs = [r for r in trainer.state.log_history if "reward" in r]
    assert all(r["composer/sdpo/skipped"] == 0 for r in logs)

    args = h.grpo_args(
        tmp_path,
        sdpo_wrapper="taid",
        beta_replay=0.0,
        max_steps=3,
        gradient_accumulation_steps=2,
        per_device_train_batch_size=4,
    )
    trainer = h.make_trainer(model_dir, tokenizer, dataset, args, hint_fn=reverse_hints)
    trainer.train()
    # stepped once per optimiser step (3), not per micro-batch (6)
    assert trainer._taid.num_steps == 3
    ts = [r["composer/taid/t"] for r in trainer.state.log_history if "composer/taid/t" in r]
    rows = [r for r in trainer.state.log_history if "reward" in r]
    # replay off: no pair, so no accuracy; its loss and counts are logged as 0
    logged = {k for k in rows[0] if k.startswith("composer/")}
    assert logged == (LOGGED_3_CHANNELS - {"composer/replay/accuracy"}) | {"composer/taid/t"}
    assert rows[0]["composer/replay/skipped"] == 2 and rows[0]["composer/loss/replay"] == 0.0
    assert ts[0] == pytest.approx(0.4) and ts[-1] > ts[0]


def test_entropy_opd_wrapper_computes(tmp_path, model_dir, tokenizer, dataset, h):
    args = h.grpo_args(tmp_path, sdpo_wrapper="entropy_opd", entropy_opd_threshold=0.0, beta_replay=0.0)
    trainer = h.make_trainer(model_dir, tokenizer, dataset, args, hint_fn=reverse_hints)
    trainer.current_gradient_accumulation_steps = 1
    trainer.model.train()
    torch.manual_seed(0)
    inputs = trainer._generate_and_score_completions(h.generation_batch(dataset, 2, 4))
    trainer.compute_loss(trainer.model, inputs)
    with_gate = trainer._metrics["train"]["composer/loss/sdpo"][-1]
    trainer.args.sdpo_wrapper = "none"
    trainer.args.entropy_opd_threshold = 0.8  # the gate's option is refused once its wrapper is off
    trainer.compose_config = trainer.args.compose_config  # the trainer builds its config once
    trainer.compute_loss(trainer.model, inputs)
    plain_jsd = trainer._metrics["train"]["composer/loss/sdpo"][-1]
    assert with_gate > plain_jsd > 0  # threshold 0: every token adds the gated forward KL


def test_trace_record_column_names_are_accepted(tmp_path, model_dir, tokenizer, dataset, h):
    """composer_core.traces.records names: teacher_prompt (hinted context), ref_chosen_logp / ref_rejected_logp."""
    n = len(dataset)
    ds = (
        dataset.add_column("teacher_prompt", [f"7|{p}" for p in dataset["prompt"]])
        .add_column("ref_chosen_logp", [-1.5] * n)
        .add_column("ref_rejected_logp", [-2.5] * n)
    )
    trainer = h.make_trainer(model_dir, tokenizer, ds, h.grpo_args(tmp_path, dpo_variant="dpo"))
    assert trainer._replay_ref_source == "column"
    trainer.current_gradient_accumulation_steps = 1
    trainer.model.train()
    torch.manual_seed(0)
    inputs = trainer._generate_and_score_completions(h.generation_batch(ds, 2, 4))
    assert inputs["composer_has_hint"].all()
    first = inputs["composer_hint_ids"][0][inputs["composer_hint_mask"][0].bool()].tolist()
    assert tokenizer.decode(first).startswith("7|")
    rows = inputs["composer_has_pair"]
    assert torch.equal(inputs["composer_ref_chosen_logps"][rows], torch.full((2,), -1.5))
    trainer.compute_loss(trainer.model, inputs)
    assert trainer._metrics["train"]["composer/loss/sdpo"][-1] > 0


def test_message_list_pairs_score_text_and_refuse_tool_calls(tmp_path, model_dir, tokenizer, rows, h):
    """chosen/rejected as assistant-message lists (trace-record layout): text is scored like the plain
    string; a tool-call action (content None, as composer-replay writes it) raises instead of being
    scored on EOS alone."""
    from datasets import Dataset

    def as_messages(r, tool_call=False):
        msg = {"role": "assistant", "content": r["chosen"], "tool_calls": None}
        if tool_call:
            call = {"id": "c1", "type": "function", "function": {"name": "bash", "arguments": "{}"}}
            msg = {"role": "assistant", "content": None, "tool_calls": [call]}
        return {**r, "chosen": [msg], "rejected": [{"role": "assistant", "content": r["rejected"]}]}

    def pair_ids(ds):
        trainer = h.make_trainer(
            model_dir, tokenizer, ds, h.grpo_args(tmp_path, dpo_variant="simpo", alpha_sdpo=0.0)
        )
        trainer.model.train()
        torch.manual_seed(0)
        return trainer._generate_and_score_completions(h.generation_batch(ds, 2, 4))

    plain = pair_ids(Dataset.from_list(rows[:8]))
    messages = pair_ids(Dataset.from_list([as_messages(r) for r in rows[:8]]))
    for key in ("composer_chosen_ids", "composer_chosen_mask", "composer_rejected_ids"):
        assert torch.equal(plain[key], messages[key])
    with pytest.raises(ValueError, match="`chosen` holds an assistant message with tool calls"):
        pair_ids(Dataset.from_list([as_messages(r, tool_call=True) for r in rows[:8]]))
