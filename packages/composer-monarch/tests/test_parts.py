"""The actors' pure parts, in-process: task, sampling, collate, scoring, replay pairs."""

from __future__ import annotations

import math

import pytest
import torch
from composer_monarch.model import TinyQwen2, completion_logits, token_logprobs
from composer_monarch.rewarder import score
from composer_monarch.rollout import PreferencePairs, Rollout, TrainBatch, pad_right, sample
from composer_monarch.task import ReverseDigits, Task
from composer_monarch.teacher import ReplayRecord, index_replay, preference_pairs
from composer_monarch.trainer import collate


def test_reverse_digits_task() -> None:
    """composer-core's digit-reversal rules on token ids (the same rules as composer-trl's main job)."""
    from composer_core.tasks import digit_reversal as rules

    task = ReverseDigits(n_digits=8, length=3)
    assert isinstance(task, Task)
    assert task.vocab_size == len(rules.VOCAB) == 16 and (task.pad_id, task.eos_id) == (0, 1)
    p = task.prompts(4, step=7)
    assert p.shape == (4, 4) and torch.equal(p, task.prompts(4, step=7))
    assert not torch.equal(p, task.prompts(4, step=8))
    assert ((p[:, :3] >= 3) & (p[:, :3] < 3 + 8)).all() and (p[:, 3] == rules.VOCAB[">"]).all()
    prompt = torch.tensor(rules.encode("381>"))
    eos = task.eos_id
    assert task.text(prompt) == "381>"
    assert task.target(prompt).tolist() == [*rules.encode("183"), eos]
    # reward: positions right over max(len(completion), len(answer)); the completion is cut at EOS
    assert task.reward(prompt, torch.tensor([*rules.encode("183"), eos])) == 1.0
    assert task.reward(prompt, torch.tensor(rules.encode("133"))) == pytest.approx(2 / 3)
    assert task.reward(prompt, torch.tensor(rules.encode("1833"))) == pytest.approx(3 / 4)
    assert task.reward(prompt, torch.tensor([], dtype=torch.long)) == 0.0
    for c in ("183", "133", "1833", "", "9"):  # exactly composer-core's (= composer-trl's) reward
        assert task.reward(prompt, torch.tensor([*rules.encode(c), eos], dtype=torch.long)) == rules.verify(
            "381>", c
        )
    # hint: the verifier's feedback on each completion in front of the prompt; none when it is right
    completions = torch.tensor([[*rules.encode("133"), eos], [*rules.encode("183"), eos]])
    hinted, has_hint = task.hinted_prompts(
        prompt.expand(2, -1), completions, torch.ones(2, 4, dtype=torch.bool)
    )
    assert (
        task.text(hinted[0]) == ".8.|381>" == rules.hint_template("381>", rules.feedback_hint("381>", "133"))
    )
    assert has_hint.tolist() == [True, False] and hinted.shape == (2, 8)
    # the mask cuts the completion: only "1" is sampled, so positions 2 and 3 are wrong
    mask = torch.tensor([[True, False, False, False]] * 2)
    hinted, has_hint = task.hinted_prompts(prompt.expand(2, -1), completions, mask)
    assert task.text(hinted[0]) == ".83|381>" and has_hint.all()
    with pytest.raises(ValueError, match="n_digits"):
        ReverseDigits(n_digits=1)
    with pytest.raises(ValueError, match="n_digits"):
        ReverseDigits(n_digits=11)


def test_tiny_qwen2_builds_the_shape_it_names() -> None:
    """Each shape field reaches the model's config under its transformers name (no field shifted)."""
    m = TinyQwen2(
        10, hidden_size=24, num_layers=3, num_heads=6, num_kv_heads=3, intermediate_size=40, max_positions=33
    )
    c = m().config
    got = (
        c.hidden_size,
        c.num_hidden_layers,
        c.num_attention_heads,
        c.num_key_value_heads,
        c.intermediate_size,
    )
    assert got == (24, 3, 6, 3, 40) and c.max_position_embeddings == 33 and c.vocab_size == 10
    assert c._attn_implementation == "eager"


def test_sample_masks_after_eos_and_logprobs_match_model() -> None:
    task = ReverseDigits()
    model = TinyQwen2(task.vocab_size)().eval()
    prompts = task.prompts(6, step=0)
    g = torch.Generator().manual_seed(0)
    ids, mask, logps = sample(model, prompts, max_new_tokens=6, eos_id=task.eos_id, pad_id=0, generator=g)
    assert ids.shape == mask.shape == logps.shape and ids.shape[0] == 6
    for row_ids, row_mask in zip(ids, mask):
        n = int(row_mask.sum())
        assert row_mask[:n].all() and not row_mask[n:].any()  # contiguous prefix
        if n < ids.shape[1]:
            assert row_ids[n - 1] == task.eos_id and (row_ids[n:] == 0).all()
    # the sampler's log-probs are the model's log-probs of the sampled tokens (teacher forcing)
    with torch.no_grad():
        ref = token_logprobs(completion_logits(model, prompts, ids), ids)
    torch.testing.assert_close(logps[mask], ref[mask], atol=1e-5, rtol=1e-5)
    assert (logps[~mask] == 0).all()
    with pytest.raises(ValueError, match="temperature"):
        sample(model, prompts, max_new_tokens=2, eos_id=4, pad_id=0, temperature=0.0)


def test_sample_temperature_changes_logprobs() -> None:
    task = ReverseDigits()
    model = TinyQwen2(task.vocab_size)().eval()
    prompts = task.prompts(4, step=0)
    hot = sample(
        model,
        prompts,
        max_new_tokens=3,
        eos_id=4,
        pad_id=0,
        temperature=2.0,
        generator=torch.Generator().manual_seed(1),
    )
    with torch.no_grad():
        ref = token_logprobs(completion_logits(model, prompts, hot[0]), hot[0], temperature=2.0)
    torch.testing.assert_close(hot[2][hot[1]], ref[hot[1]], atol=1e-5, rtol=1e-5)


def _rollout() -> Rollout:
    prompts = torch.tensor([[1, 5, 6, 2], [1, 5, 6, 2], [1, 7, 8, 2], [1, 7, 8, 2]])
    ids = torch.tensor([[6, 5, 4], [6, 4, 0], [9, 9, 9], [8, 7, 4]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0], [1, 1, 1], [1, 1, 1]], dtype=torch.bool)
    return Rollout(0, prompts, ids, mask, torch.zeros(4, 3), 0, 2)


def test_score_weights_and_rejects_non_finite() -> None:
    ro = _rollout()

    def length(prompt: torch.Tensor, completion: torch.Tensor) -> float:
        return float(len(completion))

    def first_is_six(prompt: torch.Tensor, completion: torch.Tensor) -> float:
        return float(completion[0] == 6)

    r = score(ro, [length, first_is_six], [1.0, 10.0])
    assert r.tolist() == [13.0, 12.0, 3.0, 3.0]

    def bad(prompt: torch.Tensor, completion: torch.Tensor) -> float:
        return math.nan

    with pytest.raises(ValueError, match="reward function bad returned nan"):
        score(ro, [bad], [1.0])


def test_preference_pairs_only_where_replay_beats_student() -> None:
    ro = _rollout()
    records = [
        ReplayRecord(torch.tensor([1, 5, 6, 2]), torch.tensor([6, 5, 4]), 1.0, "oracle"),
        ReplayRecord(torch.tensor([1, 5, 6, 2]), torch.tensor([6, 6, 4]), 0.5, "weak"),
        ReplayRecord(torch.tensor([1, 7, 8, 2]), torch.tensor([8, 7, 4]), 0.5, "weak"),
    ]
    index = index_replay(records)
    assert index[(1, 5, 6, 2)].source == "oracle"
    rewards = torch.tensor([1.0, 0.25, 0.0, 1.0])
    pairs = preference_pairs(ro, rewards, index, pad_id=0)
    assert isinstance(pairs, PreferencePairs)
    # row 0 ties the oracle (no pair), row 1 loses to it, row 2 loses to 'weak', row 3 beats 'weak'
    assert len(pairs) == 2 and pairs.sources == ("oracle", "weak")
    assert pairs.rejected_ids.tolist() == [[6, 4, 0], [9, 9, 9]]
    assert pairs.rejected_mask.tolist() == [[True, True, False], [True, True, True]]
    assert pairs.chosen_ids.tolist() == [[6, 5, 4], [8, 7, 4]]
    assert preference_pairs(ro, torch.ones(4), index, pad_id=0) is None


def test_collate_packs_samples_then_pairs() -> None:
    ro = _rollout()
    chosen, cmask = pad_right([torch.tensor([6, 5, 4, 4])], 0)
    rejected, rmask = pad_right([torch.tensor([6])], 0)
    pairs = PreferencePairs(ro.prompt_ids[:1], chosen, cmask, rejected, rmask, ("oracle",))
    v = 13
    batch = TrainBatch(
        step=0,
        prompt_ids=ro.prompt_ids,
        completion_ids=ro.completion_ids,
        completion_mask=ro.completion_mask,
        advantages=torch.tensor([1.0, -1.0, 0.5, -0.5]),
        inference_logprobs=-torch.ones(4, 3),
        rewards=torch.zeros(4),
        policy_version=0,
        teacher_logits=torch.ones(4, 3, v),
        pairs=pairs,
    )
    tokens, t = collate(batch, pad_id=0)
    assert tokens.shape == (6, 4 + 4)  # 4 samples + chosen + rejected, responses widened to 4
    assert t["response"][4].tolist() == [6, 5, 4, 4] and t["response"][5].tolist() == [6, 0, 0, 0]
    assert t["padding_mask"][5].tolist() == [True, False, False, False]
    assert t["advantages"].shape == (6, 1) and t["advantages"][4:].abs().sum() == 0
    assert t["policy_rows"].tolist() == [True] * 4 + [False] * 2
    assert t["chosen_rows"].tolist() == [4] and t["rejected_rows"].tolist() == [5]
    assert t["teacher_logits"].shape == (6, 4, v) and t["teacher_logits"][4:].abs().sum() == 0
    assert not t["sdpo_mask"][4:].any() and not t["sdpo_mask"][:, 3].any()
    # completions without a hint (sdpo_rows False) are not distilled
    hinted_only = collate(
        TrainBatch(**{**batch.__dict__, "sdpo_rows": torch.tensor([True, False, True, False])}), 0
    )[1]
    assert hinted_only["sdpo_mask"].any(-1).tolist() == [True, False, True, False, False, False]
    assert torch.equal(hinted_only["sdpo_mask"][[0, 2]], t["sdpo_mask"][[0, 2]])
    assert torch.equal(tokens[:, 4:], t["response"])
    bad = TrainBatch(
        **{
            **batch.__dict__,
            "pairs": PreferencePairs(
                torch.ones(1, 7, dtype=torch.long), chosen, cmask, rejected, rmask, ("x",)
            ),
        }
    )
    with pytest.raises(ValueError, match="one prompt length"):
        collate(bad, pad_id=0)


class _Unanswered:
    """A future whose answer never comes (``get`` waits out its timeout)."""

    def get(self, timeout: float | None = None) -> object:
        import time

        time.sleep(min(timeout or 0.0, 0.01))
        raise TimeoutError


class _Answered:
    def __init__(self, value: object) -> None:
        self.value = value

    def get(self, timeout: float | None = None) -> object:
        return self.value


def test_wait_enforces_the_deadlines_of_other_calls_in_flight() -> None:
    from composer_monarch import ActorTimeoutError
    from composer_monarch.errors import Call, wait

    overdue_train = Call(_Unanswered(), "trainer", "train_step", timeout_s=0.0)  # type: ignore[arg-type]
    score = Call(_Unanswered(), "rewarder", "score", timeout_s=60.0)  # type: ignore[arg-type]
    with pytest.raises(ActorTimeoutError, match="trainer actor did not answer 'train_step'") as err:
        wait(score, failures=list, others=lambda: [overdue_train, score], poll_s=0.01)
    assert err.value.role == "trainer"
    answered_train = Call(_Answered({"loss": 1.0}), "trainer", "train_step", timeout_s=0.0)  # type: ignore[arg-type]
    rollout = Call(_Answered(7), "generator", "generate", timeout_s=60.0)  # type: ignore[arg-type]
    assert wait(rollout, failures=list, others=lambda: [answered_train]) == 7  # answered in time: no error
    with pytest.raises(ActorTimeoutError, match="rewarder actor did not answer 'score' within 0 s"):
        wait(Call(_Unanswered(), "rewarder", "score", timeout_s=0.05), failures=list, poll_s=0.01)  # type: ignore[arg-type]


def test_dead_process_is_reported_by_the_role_it_hosted() -> None:
    from composer_monarch import ActorCrashedError, ComposerDriver, ComposerLoss
    from composer_monarch.errors import Call, ProcessFailure, wait

    task = ReverseDigits()
    driver = ComposerDriver(task, TinyQwen2(task.vocab_size), loss=ComposerLoss(beta_replay=0.0))
    assert driver._colocated("trainer") == ("trainer",)  # default placement: the trainer alone on proc 0
    assert driver._colocated("generator") == ("generator", "rewarder", "teacher")
    alone = ProcessFailure("generator", ("generator",), "the generator actor's process failed: Killed(sig=9)")
    score = Call(_Unanswered(), "rewarder", "score", timeout_s=60.0)  # type: ignore[arg-type]
    with pytest.raises(
        ActorCrashedError, match="the generator actor failed while the driver waited on"
    ) as err:
        wait(score, failures=lambda: [alone], poll_s=0.01)
    assert (err.value.role, err.value.waiting_on, err.value.endpoint) == ("generator", "rewarder", "score")
    shared = ProcessFailure(
        "generator", driver._colocated("generator"), "the generator actor's process failed"
    )
    with pytest.raises(ActorCrashedError, match="the rewarder actor failed in 'score'") as err:
        wait(score, failures=lambda: [shared], poll_s=0.01)  # the waited-on role died with it
    assert err.value.role == "rewarder" and err.value.roles == ("generator", "rewarder", "teacher")
