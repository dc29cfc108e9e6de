"""Channel 3 as trace replay of the student's own failures (``replay_pairs='on_policy'``), RPO's NLL term
(``rpo_alpha``) and the per-channel gradient norms, through the real TRL trainer."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
import torch.nn.functional as F

#: rewards of the generation batch 2 prompts x 4: the first group fails at rows 1 and 3, the second never
REWARDS = [1.0, 0.2, 1.0, 0.0, 1.0, 1.0, 1.0, 1.0]


def fixed_rewards(completions: list[Any], **kwargs: Any) -> list[float]:
    return [REWARDS[i % 8] for i in range(len(completions))]


def _trainer(tmp_path, model_dir, tokenizer, ds, h, reward=fixed_rewards, **overrides: Any) -> Any:
    from composer_trl import ComposerGRPOTrainer

    kw = {"alpha_sdpo": 0.0, "replay_pairs": "on_policy", "bf16": False, "log_channel_grad_norms": True}
    kw.update(overrides)
    return ComposerGRPOTrainer(
        model=str(model_dir),
        reward_funcs=[reward],
        args=h.grpo_args(tmp_path, **kw),
        train_dataset=ds,
        processing_class=tokenizer,
    )


@pytest.fixture
def chosen_only(dataset: Any) -> Any:
    return dataset.remove_columns(["rejected"])


def test_on_policy_pairs_are_the_failed_completions_against_the_chosen_column(
    tmp_path, model_dir, tokenizer, chosen_only, h
):
    trainer = _trainer(tmp_path, model_dir, tokenizer, chosen_only, h)
    trainer.model.train()
    batch = h.generation_batch(chosen_only, 2, 4)
    out = trainer._generate_and_score_completions(batch)
    assert out["composer_has_pair"].tolist() == [False, True, False, True, False, False, False, False]
    assert int(out["composer_replay_num_items"]) == 2
    t = out["completion_ids"].size(1)
    for i in (1, 3):
        assert torch.equal(out["composer_rejected_ids"][i, :t], out["completion_ids"][i])
        assert torch.equal(out["composer_rejected_mask"][i, :t], out["completion_mask"][i])
        ids, _ = trainer._pair_ids(batch[i]["chosen"], None, "chosen")
        assert out["composer_chosen_ids"][i, : len(ids)].tolist() == ids


def _summed(trainer: Any, prompt_ids, prompt_mask, ids, mask, attn) -> torch.Tensor:
    with torch.no_grad():
        logps, _, _ = trainer._get_per_token_logps_and_entropies(
            trainer.model, torch.cat([prompt_ids, ids], 1), torch.cat([prompt_mask, attn], 1), ids.size(1)
        )
    return (logps * mask).sum(-1)


def test_replay_loss_is_the_closed_form_of_the_policys_own_log_probs(
    tmp_path, model_dir, tokenizer, chosen_only, h
):
    """SimPO + RPO's NLL on the two failed completions: -log σ(β(ℓc/|c| − ℓr/|r|) − γ) + α·(−ℓc/|c|), summed over
    the pairs / 2, with ℓr read from separate forwards of prompt ⊕ the student's own completion."""
    trainer = _trainer(tmp_path, model_dir, tokenizer, chosen_only, h, dpo_variant="simpo", rpo_alpha=0.5)
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1
    out = trainer._generate_and_score_completions(h.generation_batch(chosen_only, 2, 4))
    trainer.compute_loss(trainer.model, out)
    rows = torch.tensor([1, 3])
    p_ids, p_mask = out["prompt_ids"][rows], out["prompt_mask"][rows]
    lr = _summed(
        trainer,
        p_ids,
        p_mask,
        out["completion_ids"][rows],
        out["completion_mask"][rows],
        out["completion_mask"][rows],
    )
    c_ids, c_mask = out["composer_chosen_ids"][rows], out["composer_chosen_mask"][rows]
    lc = _summed(trainer, p_ids, p_mask, c_ids, c_mask, out["composer_chosen_attn"][rows])
    nc, nr = c_mask.sum(-1), out["completion_mask"][rows].sum(-1)
    a = trainer.args
    per_pair = -F.logsigmoid(a.simpo_beta * (lc / nc - lr / nr) - a.simpo_gamma) + 0.5 * (-lc / nc)
    m = trainer._metrics["train"]
    assert m["composer/replay/pairs"][-1] == 2
    assert m["composer/loss/replay"][-1] == pytest.approx(float(per_pair.sum() / 2), rel=1e-5)


def test_all_success_groups_give_no_pair_and_no_nan(tmp_path, model_dir, tokenizer, chosen_only, h):
    trainer = _trainer(
        tmp_path,
        model_dir,
        tokenizer,
        chosen_only,
        h,
        reward=lambda completions, **k: [1.0] * len(completions),
    )
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1
    out = trainer._generate_and_score_completions(h.generation_batch(chosen_only, 2, 4))
    assert not out["composer_has_pair"].any() and int(out["composer_replay_num_items"]) == 0
    trainer.state.logging_steps = 1  # as train() sets it: this step is logged, so the norms are computed
    loss = trainer.compute_loss(trainer.model, out)
    m = trainer._metrics["train"]
    assert math.isfinite(float(loss.detach())) and m["composer/replay/pairs"][-1] == 0
    assert m["composer/replay/skipped"][-1] == 1 and m["composer/loss/replay"][-1] == 0.0
    assert m["composer/grad_norm/replay"][-1] == 0.0


def test_gradient_accumulation_normaliser_is_the_global_pair_count(
    tmp_path, model_dir, tokenizer, chosen_only, h
):
    from trl.trainer.utils import split_tensor_dict

    kw = {"dpo_variant": "dpo", "num_iterations": 2}
    full = _trainer(tmp_path, model_dir, tokenizer, chosen_only, h, **kw)
    acc = _trainer(
        tmp_path,
        model_dir,
        tokenizer,
        chosen_only,
        h,
        per_device_train_batch_size=4,
        gradient_accumulation_steps=2,
        **kw,
    )
    full.model.train()
    acc.model.train()
    torch.manual_seed(0)
    inputs = full._generate_and_score_completions(h.generation_batch(chosen_only, 2, 4))
    inputs["advantages"] = torch.zeros(8)  # isolate channel 3
    full.current_gradient_accumulation_steps = 1
    full.compute_loss(full.model, inputs).backward()
    acc.current_gradient_accumulation_steps = 2
    perm = torch.tensor([0, 1, 4, 5, 2, 3, 6, 7])  # one failure in each half
    for half in split_tensor_dict(
        {k: (v[perm] if torch.is_tensor(v) and v.ndim > 0 else v) for k, v in inputs.items()}, 2
    ):
        acc.compute_loss(acc.model, half).backward()
    assert full._metrics["train"]["composer/loss/replay"][-1] > 0
    for (n, pf), (_, pa) in zip(full.model.named_parameters(), acc.model.named_parameters()):
        torch.testing.assert_close(pa.grad, pf.grad, atol=1e-6, rtol=1e-5, msg=n)


def test_trains_under_bf16_autocast_with_the_students_failures(
    tmp_path, model_dir, tokenizer, chosen_only, h
):
    from composer_core.tasks.digit_reversal import reverse_reward

    trainer = _trainer(
        tmp_path,
        model_dir,
        tokenizer,
        chosen_only,
        h,
        reward=reverse_reward,
        bf16=True,
        rpo_alpha=0.2,
        dpo_variant="dpo",
    )
    trainer.train()
    rows = [r for r in trainer.state.log_history if "reward" in r]
    assert len(rows) == 2 and all(r["composer/replay/pairs"] > 0 for r in rows)
    assert all(math.isfinite(r["composer/loss/replay"]) and r["composer/grad_norm/replay"] > 0 for r in rows)


# ------------------------------------------------------------------ options and errors
def test_on_policy_options_and_their_errors(tmp_path, model_dir, tokenizer, dataset, chosen_only, h):
    with pytest.raises(ValueError, match=r"\['rejected'\] would be ignored: drop the column"):
        _trainer(tmp_path, model_dir, tokenizer, dataset, h)
    with pytest.raises(ValueError, match="needs a `chosen` column"):
        _trainer(tmp_path, model_dir, tokenizer, chosen_only.remove_columns(["chosen"]), h)
    with pytest.raises(ValueError, match="`replay_pairs`='on_policy' acts only with channel 3 on"):
        h.grpo_args(tmp_path, replay_pairs="on_policy", beta_replay=0.0)
    with pytest.raises(ValueError, match="replay_reference='column'"):
        h.grpo_args(tmp_path, replay_pairs="on_policy", replay_reference="column")
    with pytest.raises(ValueError, match="replay_pairs"):
        h.grpo_args(tmp_path, replay_pairs="offline")
    with pytest.raises(ValueError, match=r"`rpo_alpha`=0.5 acts only with channel 3 on"):
        h.grpo_args(tmp_path, rpo_alpha=0.5, beta_replay=0.0)
    with pytest.raises(ValueError, match="rpo_alpha"):
        h.grpo_args(tmp_path, rpo_alpha=-1.0)
    # the threshold decides channel 3's failures too: accepted with the 'hint' teacher context
    args = h.grpo_args(tmp_path, alpha_sdpo=0.0, replay_pairs="on_policy", success_reward_threshold=0.5)
    assert args.success_reward_threshold == 0.5 and args.compose_config.replay.rpo_alpha == 0.0


def test_options_from_cli_strings(tmp_path):
    from composer_trl import ComposerGRPOConfig
    from transformers import HfArgumentParser

    (args,) = HfArgumentParser(ComposerGRPOConfig).parse_args_into_dataclasses(
        ["--output_dir", str(tmp_path), "--use_cpu", "--beta_replay", "1", "--replay_pairs", "on_policy",
         "--rpo_alpha", "0.5", "--dpo_variant", "simpo", "--log_channel_grad_norms", "false"]
    )  # fmt: skip
    assert args.replay_pairs == "on_policy" and args.rpo_alpha == 0.5 and args.log_channel_grad_norms is False
    assert (
        args.compose_config.replay.rpo_alpha == 0.5 and type(args.compose_config.replay).__name__ == "SimPO"
    )


# ------------------------------------------------------------------ per-channel gradient norms
def _params(model: Any) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def test_grad_norm_logging_leaves_training_bit_for_bit_unchanged(tmp_path, model_dir, tokenizer, dataset, h):
    from composer_core.tasks.digit_reversal import reverse_hints

    runs = []
    for on in (True, None):  # None: the default, off (one extra backward per channel is opt-in)
        opts = {} if on is None else {"log_channel_grad_norms": on}
        args = h.grpo_args(tmp_path, max_steps=2, **opts)
        trainer = h.make_trainer(model_dir, tokenizer, dataset, args, hint_fn=reverse_hints)
        trainer.train()
        runs.append((_params(trainer.model), trainer.state.log_history))
    (p_on, log_on), (p_off, log_off) = runs
    assert all(torch.equal(p_on[n], p_off[n]) for n in p_on)
    on_rows = [r for r in log_on if "reward" in r]
    assert all(r["composer/grad_norm/sdpo"] > 0 and r["composer/grad_norm/replay"] > 0 for r in on_rows)
    assert not any(k.startswith("composer/grad_norm/") for r in log_off for k in r)


def test_one_channel_alone_its_norm_is_the_total_gradient_norm_before_clipping(
    tmp_path, model_dir, tokenizer, dataset, h
):
    args = h.grpo_args(
        tmp_path,
        alpha_sdpo=0.0,
        beta_replay=0.0,
        bf16=False,
        max_steps=2,
        logging_steps=2,
        log_channel_grad_norms=True,
    )
    trainer = h.make_trainer(model_dir, tokenizer, dataset, args)
    trainer.train()
    rows = [r for r in trainer.state.log_history if "reward" in r]
    assert len(rows) == 1  # logged at step 2 only: the norms are computed on that step alone
    r = rows[0]
    assert r["composer/grad_norm/policy"] == pytest.approx(r["grad_norm"], rel=1e-5)
    assert r["composer/grad_norm/sdpo"] == 0.0 and r["composer/grad_norm/replay"] == 0.0


def test_moe_router_loss_path_forwards_the_chosen_rows_alone(tmp_path, moe_dir, tokenizer, chosen_only, h):
    """With TRL's router aux loss the pairs get a forward of their own: the chosen rows only; the rejected side
    still comes from the policy forward. Same loss as the closed form of test above, on the MoE model."""
    trainer = _trainer(tmp_path, moe_dir, tokenizer, chosen_only, h, dpo_variant="simpo")
    assert trainer.aux_loss_enabled
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1
    out = trainer._generate_and_score_completions(h.generation_batch(chosen_only, 2, 4))
    trainer.compute_loss(trainer.model, out)
    rows = torch.tensor([1, 3])
    p_ids, p_mask = out["prompt_ids"][rows], out["prompt_mask"][rows]
    cm = out["completion_mask"][rows]
    lr = _summed(trainer, p_ids, p_mask, out["completion_ids"][rows], cm, cm)
    c_ids, c_mask = out["composer_chosen_ids"][rows], out["composer_chosen_mask"][rows]
    lc = _summed(trainer, p_ids, p_mask, c_ids, c_mask, out["composer_chosen_attn"][rows])
    a = trainer.args
    per_pair = -F.logsigmoid(a.simpo_beta * (lc / c_mask.sum(-1) - lr / cm.sum(-1)) - a.simpo_gamma)
    assert trainer._metrics["train"]["composer/loss/replay"][-1] == pytest.approx(
        float(per_pair.mean()), rel=1e-5
    )


def test_composer_train_turns_channel_3_on_for_a_chosen_column_with_on_policy_pairs():
    from composer_trl.recipe import choose_channels

    chosen, _ = choose_channels({"replay_pairs": "on_policy"}, {"prompt", "chosen"}, hints=True)
    assert chosen["beta_replay"] == 1.0
    assert choose_channels({}, {"prompt", "chosen"}, hints=True)[0]["beta_replay"] == 0.0
