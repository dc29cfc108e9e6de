"""Unit tests of the verl producers' pure parts (hint contexts, pair rows, ordering, config checks).

The producers' TransferQueue / actor glue runs inside verl's real loop in test_main_ppo_e2e.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from composer_verl.config import ComposerVerlConfig
from composer_verl.producers import ComposerProducers, check_settings
from composer_verl.rows import (
    RecordPairs,
    dataset_pairs,
    hinted_prompt_ids,
    on_policy_pair_rows,
    pair_sample,
    pairs_last,
    render_prompt_ids,
    response_ids,
    with_prompt,
)
from verl_cpu_testkit.task import build_tokenizer

C = ComposerVerlConfig.from_mapping
ACTOR = {"shuffle": False, "use_dynamic_bsz": False, "ppo_micro_batch_size_per_gpu": 4}


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


def test_hinted_prompt_is_the_prompt_plus_one_hint_message(tok) -> None:
    prompt = [{"role": "user", "content": "381>"}]
    student = render_prompt_ids(tok, prompt)
    teacher = hinted_prompt_ids(tok, prompt, ".8.|")
    gen = "<|im_start|>assistant\n"
    assert tok.decode(student) == "<|im_start|>user\n381><|im_end|>\n" + gen
    assert tok.decode(teacher) == "<|im_start|>user\n381><|im_end|>\n<|im_start|>user\n.8.|<|im_end|>\n" + gen
    # student prompt (minus the generation prompt) is a prefix of the teacher prompt
    n_gen = len(tok.encode(gen, add_special_tokens=False))
    assert n_gen == 11 and teacher[: len(student) - n_gen] == student[:-n_gen]


def test_with_prompt_keeps_the_response_and_rebuilds_positions(tok) -> None:
    sample = {
        "prompts": torch.tensor([5, 6, 7]),
        "responses": torch.tensor([8, 9]),
        "input_ids": torch.tensor([5, 6, 7, 8, 9]),
        "attention_mask": torch.ones(5, dtype=torch.int64),
        "position_ids": torch.arange(5),
        "response_mask": torch.tensor([1, 1]),
        "uid": "u",
    }
    out = with_prompt(sample, [1, 2, 3, 4])
    assert out["input_ids"].tolist() == [1, 2, 3, 4, 8, 9]
    assert out["position_ids"].tolist() == list(range(6))
    assert out["attention_mask"].tolist() == [1] * 6  # rebuilt because the sample has one
    assert "attention_mask" not in with_prompt(
        {k: v for k, v in sample.items() if k != "attention_mask"}, [1]
    )
    assert torch.equal(out["responses"], sample["responses"]) and out["uid"] == "u"
    assert sample["input_ids"].tolist() == [5, 6, 7, 8, 9]  # the original is untouched


def test_pair_rows_have_zero_reward_full_mask_and_eos(tok) -> None:
    template = {
        "prompts": torch.tensor([5]),
        "responses": torch.tensor([8]),
        "input_ids": torch.tensor([5, 8]),
        "attention_mask": torch.ones(2, dtype=torch.int64),
        "position_ids": torch.arange(2),
        "response_mask": torch.tensor([1]),
        "loss_mask": torch.tensor([1]),
        "rm_scores": torch.tensor([0.7]),
        "rollout_log_probs": torch.tensor([-1.0]),
        "uid": "g",
    }
    resp = response_ids(tok, "aaa", length=8)
    assert resp == tok("aaa", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    assert response_ids(tok, "aaaaaaaaaa", length=4) == tok("aaaa", add_special_tokens=False)["input_ids"]
    row = pair_sample(template, [1, 2], resp)
    assert row["input_ids"].tolist() == [1, 2, *resp]
    assert row["response_mask"].tolist() == [1] * len(resp) == row["loss_mask"].tolist()
    assert row["rm_scores"].tolist() == [0.0] * len(resp)
    assert row["uid"].startswith("composer-pair-") and row["uid"] != template["uid"]


def test_pairs_last_keeps_order_and_puts_pairs_adjacent() -> None:
    keys = ["a", "p0c", "b", "p1r", "c", "p0r", "p1c", "d"]
    order = pairs_last(keys, [("p0c", "p0r"), ("p1c", "p1r")])
    assert [keys[i] for i in order] == ["a", "b", "c", "d", "p0c", "p0r", "p1c", "p1r"]


def test_dataset_pairs_one_per_group_and_clear_error() -> None:
    rows = [
        {"uid": "g1", "raw_prompt": [{"role": "user", "content": "x"}], "chosen": "aa", "rejected": "b"},
        {"uid": "g1", "raw_prompt": [{"role": "user", "content": "x"}], "chosen": "aa", "rejected": "b"},
        {"uid": "g2", "raw_prompt": "y", "chosen": [{"role": "assistant", "content": "c"}], "rejected": "d"},
    ]
    pairs = dataset_pairs(rows)
    assert [(p.prompt, p.chosen, p.rejected) for p in pairs] == [
        ([{"role": "user", "content": "x"}], "aa", "b"),
        ([{"role": "user", "content": "y"}], "c", "d"),
    ]
    with pytest.raises(ValueError, match="chosen"):
        dataset_pairs([{"uid": "g", "raw_prompt": "x"}])


def test_record_pairs_cycle_in_file_order(tmp_path: Path) -> None:
    from composer_core.traces.records import TraceRecord, write_records

    def rec(i: int) -> TraceRecord:
        prompt = [{"role": "user", "content": f"q{i}"}]
        completion = [{"role": "assistant", "content": f"bad{i}"}]
        return TraceRecord(
            id=f"e{i}@1",
            episode_id=f"e{i}",
            turn=1,
            prompt=prompt,
            completion=completion,
            chosen=[{"role": "assistant", "content": f"good{i}"}],
            rejected=completion,
        )

    path = tmp_path / "records.jsonl"
    write_records([rec(0), rec(1), rec(2)], path)
    source = RecordPairs(path, n=2)
    assert [p.chosen for p in source.take()] == ["good0", "good1"]
    assert [p.chosen for p in source.take()] == ["good2", "good0"]
    assert source.take()[0].rejected == "bad1"


def test_hint_fn_import_paths_and_errors(tok) -> None:
    def hint_fn(path: str):
        return ComposerProducers(C({"hint_fn": path, "alpha_sdpo": 0.5}), tok, 8).hint_fn

    fn = hint_fn("verl_cpu_testkit.task:hint_from_feedback")
    assert fn("p", "r", 1.0, {"feedback": ""}) is None  # the verifier's feedback of a correct answer
    assert hint_fn("verl_cpu_testkit.task.hint_from_feedback") is fn
    with pytest.raises(ValueError, match=r"composer\.hint_fn"):
        hint_fn("verl_cpu_testkit.task:nope")
    with pytest.raises(ValueError, match=r"composer\.hint_fn"):
        hint_fn("verl_cpu_testkit.task:MODEL")


def test_config_refuses_producers_without_effect_and_split_pairs() -> None:
    with pytest.raises(ValueError, match="unknown key"):
        C({"hint": "x"})
    assert C({"pairs_per_step": "3"}).pairs_per_step == 3  # CLI strings
    with pytest.raises(ValueError, match="alpha_sdpo is 0"):
        C({"hint_fn": "m:f"})
    with pytest.raises(ValueError, match="beta_replay is 0"):
        C({"pair_source": "dataset"})
    pairs = C({"pair_source": "dataset", "beta_replay": 0.1})
    with pytest.raises(ValueError, match="shuffle"):
        check_settings(pairs, {**ACTOR, "shuffle": True})
    with pytest.raises(ValueError, match="even"):
        check_settings(pairs, {**ACTOR, "ppo_micro_batch_size_per_gpu": 3})
    check_settings(pairs, ACTOR)
    check_settings(C({}), {**ACTOR, "shuffle": True})  # no pairs: any actor layout


def test_hints_get_prompt_response_reward_and_feedback(tok) -> None:
    producers = ComposerProducers(
        C({"hint_fn": "verl_cpu_testkit.task:hint_from_feedback", "alpha_sdpo": 1}), tok, 8
    )
    enc = lambda s: torch.tensor(tok(s, add_special_tokens=False)["input_ids"])  # noqa: E731
    samples = [
        {
            "prompts": enc("381>"),
            "responses": enc("133"),
            "response_mask": torch.tensor([1, 1, 1]),
            "rm_scores": torch.tensor([0.0, 0.0, 1 / 3]),
            "extra_fields": {"reward_extra_info": {"feedback": ".8.|"}},
        },
        {
            "prompts": enc("12>"),
            "responses": enc("21"),
            "response_mask": torch.tensor([1, 1]),
            "rm_scores": torch.tensor([0.0, 1.0]),
            "feedback": "",
        },
    ]
    assert [(j.index, j.hint) for j in producers._hint_jobs(samples, skip={})] == [(0, ".8.|")]
    assert producers._hint_jobs(samples, skip={0: 1}) == []  # pair rows are not asked


def test_example_yaml_turns_the_producers_on() -> None:
    from importlib.resources import files

    import yaml

    text = files("composer_verl.examples").joinpath("composer_grpo_producers.yaml").read_text()
    cfg = yaml.safe_load(text)
    composer = C(cfg["composer"])  # every option in the one section, none in an environment variable
    assert composer.hint_fn and composer.pair_source == "dataset" and composer.compose.alpha_sdpo > 0
    assert "ray_kwargs" not in cfg
    check_settings(composer, {**ACTOR, **cfg["actor_rollout_ref"]["actor"]})


def _rollout_row(tok, uid: str, response: list[int], reward: float, **extra: object) -> dict:
    prompt = [5, 6]
    ids = torch.tensor(prompt + response)
    return {
        "prompts": torch.tensor(prompt),
        "responses": torch.tensor(response),
        "input_ids": ids,
        "attention_mask": torch.ones(len(ids), dtype=torch.int64),
        "position_ids": torch.arange(len(ids)),
        "response_mask": torch.tensor([1] * (len(response) - 1) + [0]),  # e.g. a tool token at the end
        "rm_scores": torch.tensor([0.0] * (len(response) - 1) + [reward]),
        "rollout_log_probs": torch.full((len(response),), -1.0),
        "uid": uid,
        "raw_prompt": [{"role": "user", "content": "q"}],
        "chosen": "aa",
        **extra,
    }


def test_on_policy_pairs_are_each_failed_response_against_the_chosen_column(tok) -> None:
    """Rewards [1, 0.2, 1, 0] in one uid group: exactly rows 1 and 3 are rejected sides, each after its own prompt
    with its own response ids and mask; the chosen side is the row's `chosen` text; an all-success group adds none."""
    responses = [[8, 9], [9, 9, 8], [8, 8], [9, 8]]
    rows = [_rollout_row(tok, "g", r, w) for r, w in zip(responses, [1.0, 0.2, 1.0, 0.0])]
    rows += [_rollout_row(tok, "h", [8, 9], 1.0) for _ in range(4)]
    pairs = on_policy_pair_rows(rows, 1.0, tok, length=8)
    assert len(pairs) == 2
    for (chosen, rejected), i in zip(pairs, (1, 3)):
        assert rejected["responses"].tolist() == responses[i]
        assert rejected["prompts"].tolist() == chosen["prompts"].tolist() == [5, 6]
        assert rejected["response_mask"].tolist() == rows[i]["response_mask"].tolist()
        assert chosen["responses"].tolist() == response_ids(tok, "aa", 8)
        assert chosen["rm_scores"].sum() == rejected["rm_scores"].sum() == 0
        assert chosen["uid"].startswith("composer-pair-")
    assert on_policy_pair_rows(rows[4:], 1.0, tok, length=8) == []
    with pytest.raises(ValueError, match=r"\['rejected'\] would be ignored"):
        on_policy_pair_rows([_rollout_row(tok, "g", [8], 0.0, rejected="b")], 1.0, tok, length=8)
    with pytest.raises(ValueError, match="needs a `chosen` column"):
        on_policy_pair_rows([{k: v for k, v in rows[1].items() if k != "chosen"}], 1.0, tok, length=8)


def test_on_policy_config() -> None:
    on_policy = {"pair_source": "dataset", "replay_pairs": "on_policy", "beta_replay": 0.1}
    cfg = C({**on_policy, "success_reward_threshold": 0.5})
    assert cfg.replay_pairs == "on_policy" and cfg.success_reward_threshold == 0.5
    with pytest.raises(ValueError, match="pair_source=dataset"):
        C({**on_policy, "pair_source": "pairs.jsonl"})
    with pytest.raises(ValueError, match="replay_pairs"):
        C({**on_policy, "replay_pairs": "offline"})
    with pytest.raises(
        ValueError, match="success_reward_threshold"
    ):  # no on-policy pairs: SDPO's option alone
        C({"pair_source": "dataset", "beta_replay": 0.1, "success_reward_threshold": 0.5})
