"""SDPO's teacher context built from the ``uid`` group (``composer.sdpo_teacher_context``) and the teacher-weights
options (``sdpo_teacher``): composer-verl's producer path against composer_core's conformance case, uid grouping of
non-contiguous rows, masking, rendering, and the one-line refusals.

The teacher's weights inside verl's actor engine (swap, EMA, checkpoint) are tested in test_actor_cpu.py; the
whole loop in test_main_ppo_e2e.py.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest
import torch
from composer_core.sdpo import TeacherContextOptions, build_teacher_contexts
from composer_testkit.teacher_context import TEACHER_CONTEXT_CASES, check_teacher_context
from composer_verl.config import ComposerVerlConfig
from composer_verl.producers import (
    CONTEXT_KEYS,
    ComposerProducers,
    ProducerConfig,
    check_settings,
    context_prompt_ids,
    group_teacher_contexts,
    render_prompt_ids,
)
from verl_cpu_testkit.task import build_tokenizer

HINT_FN = "verl_cpu_testkit.task:hint_from_feedback"  # the row's `feedback` field is its feedback text
ACTOR = {"shuffle": False, "use_dynamic_bsz": False, "ppo_micro_batch_size_per_gpu": 4}


class TableTokenizer:
    """Decodes token i to ``table[i]`` (the completions of a case need letters the test kit's tokenizer lacks)."""

    def __init__(self, table: Sequence[str]) -> None:
        self.table = list(table)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return "".join(self.table[int(i)] for i in ids)


def _sample(uid: str, prompt: Any, completion_id: int, reward: float, feedback: str | None) -> dict[str, Any]:
    """One row as the producers read it from TransferQueue (verl's v1 agent-loop fields)."""
    return {
        "uid": uid,
        "raw_prompt": prompt,
        "prompts": torch.tensor([0]),
        "responses": torch.tensor([completion_id]),
        "response_mask": torch.tensor([1]),
        "rm_scores": torch.tensor([reward]),
        "feedback": feedback,
    }


def _interleave(n: int, group_size: int) -> list[int]:
    """A row order where no two rows of one group are adjacent (when there are several groups)."""
    return sorted(range(n), key=lambda i: (i % group_size, i // group_size))


def _producer_build(
    prompts: Sequence[Any],
    completions: Sequence[str],
    rewards: Sequence[float],
    group_size: int,
    feedback: Sequence[str | None] | None,
    options: TeacherContextOptions,
) -> tuple[list[Any], list[bool]]:
    """composer-verl's path from a rollout group to teacher contexts: the ``composer:`` section → ProducerConfig →
    ComposerProducers reading TransferQueue-shaped rows (interleaved, grouped back by uid)."""
    section = {k: getattr(options, k) for k in CONTEXT_KEYS}
    if options.uses_feedback:
        section["hint_fn"] = HINT_FN
    producers = ComposerProducers(ProducerConfig.from_mapping(section), TableTokenizer(completions), 8)
    n = len(prompts)
    order = _interleave(n, group_size)
    samples = [
        _sample(f"g{i // group_size}", prompts[i], i, rewards[i], None if feedback is None else feedback[i])
        for i in order
    ]
    built = producers._group_contexts(samples, skip=())
    contexts: list[Any] = [None] * n
    mask = [False] * n
    for row, i in enumerate(order):
        if row in built.contexts:
            contexts[i] = built.contexts[row]
            mask[i] = True
    return contexts, mask


def test_core_teacher_context_conformance_through_the_producers() -> None:
    passed = check_teacher_context(_producer_build)
    assert len(passed) == len(TEACHER_CONTEXT_CASES) == 5


def test_conformance_catches_a_wrong_grouping() -> None:
    """The case fails when rows are grouped by position instead of uid (a test that can fail)."""
    from composer_core.testing.conformance import ConformanceError

    def by_position(prompts, completions, rewards, group_size, feedback, options):  # type: ignore[no-untyped-def]
        order = _interleave(len(prompts), group_size)
        ctx = build_teacher_contexts(
            [prompts[i] for i in order],
            [completions[i] for i in order],
            [rewards[i] for i in order],
            group_size,
            options,
            feedback=None if feedback is None else [feedback[i] for i in order],
        )
        out: list[Any] = [None] * len(order)
        mask = [False] * len(order)
        for row, i in enumerate(order):
            out[i], mask[i] = ctx.contexts[row], ctx.mask[row]
        return out, mask

    with pytest.raises(ConformanceError):
        check_teacher_context(by_position)


def test_groups_are_gathered_by_uid_wherever_the_rows_sit() -> None:
    """Rows of groups a/b interleaved, one group of 3 and one of 2 (two core calls), pair rows skipped."""
    opts = TeacherContextOptions(
        sdpo_teacher_context="success",
        reprompt_template="{prompt}{solution}",
        solution_template="<{demonstration}>",
    )
    uids = ["a", "b", "a", "pair", "b", "a"]
    prompts = ["P", "Q", "P", "X", "Q", "P"]
    completions = ["a0", "b0", "a1", "xx", "b1", "a2"]
    rewards = [0.0, 1.0, 1.0, 1.0, 0.0, 0.0]
    built = group_teacher_contexts([0, 1, 2, 4, 5], uids, prompts, completions, rewards, opts)
    # group a = rows 0, 2, 5 (row 2 succeeded); group b = rows 1, 4 (row 1 succeeded); row 3 (a pair row) not asked
    assert built.contexts == {0: "P<a1>", 5: "P<a1>", 4: "Q<b0>"}
    assert built.metrics == {
        "success_group_fraction": 1.0,
        "success_sample_fraction": 3 / 5,
        "feedback_used_fraction": 0.0,
        "reprompt_sample_fraction": 3 / 5,
    }


def test_teacher_prompts_render_the_reprompt_and_mask_rows_without_context() -> None:
    """ComposerProducers' step: the rendered chat ids of each distilled row; rows absent get SDPO mask 0."""
    tok = build_tokenizer()
    cfg = ProducerConfig(
        sdpo_teacher_context="success",
        success_reward_threshold=0.5,
        reprompt_template="{prompt}|{solution}",
        solution_template="{demonstration}",
    )
    producers = ComposerProducers(cfg, tok, 8)
    enc = lambda s: torch.tensor(tok(s, add_special_tokens=False)["input_ids"])  # noqa: E731
    msg = [{"role": "user", "content": "12>"}]
    rows = [("g1", "21", 1.0), ("g2", "1", 0.0), ("g1", "12", 0.0), ("g2", "2", 0.25)]
    samples = [
        {
            "uid": uid,
            "raw_prompt": msg,
            "prompts": enc("12>"),
            "responses": enc(resp),
            "response_mask": torch.ones(len(resp), dtype=torch.int64),
            "rm_scores": torch.tensor([0.0] * (len(resp) - 1) + [r]),
        }
        for uid, resp, r in rows
    ]
    metrics: dict[str, float] = {}
    ids = producers._teacher_prompts(samples, skip=(), metrics=metrics)
    assert sorted(ids) == [2]  # g1's failure sees its sibling's "21"; g2 has no success: masked
    assert ids[2] == render_prompt_ids(tok, [{"role": "user", "content": "12>|21"}])
    assert metrics["composer/sdpo/success_group_fraction"] == 0.5
    assert metrics["composer/sdpo/reprompt_sample_fraction"] == 0.25


def test_max_reprompt_len_keeps_the_last_tokens() -> None:
    tok = build_tokenizer()
    ctx = [{"role": "user", "content": "123>"}]
    full = render_prompt_ids(tok, ctx)
    assert context_prompt_ids(tok, ctx, None) == full
    assert context_prompt_ids(tok, ctx, 5) == full[-5:]


def test_feedback_comes_from_the_hint_fn() -> None:
    """success+feedback: the failed row sees the success and its own feedback (hint_fn's text), blank = none."""
    cfg = ProducerConfig(
        hint_fn=HINT_FN,
        sdpo_teacher_context="success+feedback",
        reprompt_template="{prompt}{solution}{feedback}",
        solution_template="[{demonstration}]",
        feedback_template="<{feedback}>",
    )
    producers = ComposerProducers(cfg, TableTokenizer(["ok", "bad", "worse"]), 8)
    samples = [
        _sample("g", "p", 0, 1.0, "  "),
        _sample("g", "p", 1, 0.0, "off by one"),
        _sample("g", "p", 2, 0.0, None),
    ]
    assert producers._group_contexts(samples, skip=()).contexts == {1: "p[ok]<off by one>", 2: "p[ok]"}


def test_rows_without_reward_raise_naming_the_option() -> None:
    producers = ComposerProducers(ProducerConfig(sdpo_teacher_context="success"), TableTokenizer(["a"]), 8)
    row = _sample("g", "p", 0, 1.0, None)
    del row["rm_scores"]
    with pytest.raises(ValueError, match=r"composer\.sdpo_teacher_context=success needs each row's reward"):
        producers._group_contexts([row], skip=())


@pytest.mark.parametrize(
    ("section", "match"),
    [
        (
            {"sdpo_teacher_context": "success", "reprompt_template": "{prompt}{answer}"},
            r"unknown placeholder.*\{answer\}",
        ),
        ({"sdpo_teacher_context": "nope"}, r"sdpo_teacher_context.*is not supported"),
        ({"sdpo_teacher_context": "success", "demo_pick": "last"}, "demo_pick"),
        ({"sdpo_teacher_context": "success", "max_reprompt_len": 0}, "max_reprompt_len"),
        ({"success_reward_threshold": 0.5}, "only act"),  # a group-only option with the 'hint' source
        ({"sdpo_teacher_context": "success", "hint_fn": HINT_FN}, "is not read with"),
        ({"sdpo_teacher_context": "feedback"}, "needs each completion's feedback"),
        ({"sdpo_teacher_context": "success", "hint_role": "system"}, "hint_role"),
        ({"sdpo_teacher_contexts": "success"}, "unknown key"),
    ],
)
def test_bad_sections_raise_one_line(section: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match) as err:
        ProducerConfig.from_mapping(section)
    assert "\n" not in str(err.value)
    assert str(err.value).startswith("composer")


def test_group_context_needs_alpha_sdpo() -> None:
    producers = ProducerConfig(sdpo_teacher_context="success")
    assert producers.hints and producers.enabled
    with pytest.raises(ValueError, match="alpha_sdpo is 0"):
        check_settings(producers, 0.0, 0.0, ACTOR)
    check_settings(producers, 0.5, 0.0, ACTOR)


def test_teacher_weight_options_are_core_options() -> None:
    cfg = ComposerVerlConfig(
        alpha_sdpo=0.5, sdpo_teacher="ema", teacher_update_rate=0.25, teacher_sync_steps=2
    )
    assert (cfg.teacher.sdpo_teacher, cfg.teacher.teacher_update_rate, cfg.teacher.teacher_sync_steps) == (
        "ema",
        0.25,
        2,
    )
    assert ComposerVerlConfig().teacher.sdpo_teacher == "live"
    assert "teacher" not in cfg.to_dict() and cfg.to_dict()["sdpo_teacher"] == "ema"


@pytest.mark.parametrize(
    ("mapping", "match"),
    [
        ({"alpha_sdpo": 0.5, "sdpo_teacher": "frozen"}, "sdpo_teacher.*is not supported"),
        ({"alpha_sdpo": 0.5, "sdpo_teacher": "ema", "teacher_update_rate": 0.0}, "teacher_update_rate"),
        ({"alpha_sdpo": 0.5, "teacher_sync_steps": 3}, "act only with sdpo_teacher='ema'"),  # no silent no-op
        ({"sdpo_teacher": "base"}, "alpha_sdpo is 0"),
    ],
)
def test_bad_teacher_options_raise_one_line(mapping: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match) as err:
        ComposerVerlConfig.from_mapping(mapping)
    assert "\n" not in str(err.value) and str(err.value).startswith("composer-verl config")


def test_an_ema_teacher_without_a_channel_2_producer_raises() -> None:
    """sdpo_teacher acts on the producers' teacher contexts: without any it would do nothing."""
    from composer_verl.config import configure
    from omegaconf import OmegaConf

    configure({"alpha_sdpo": 0.5, "sdpo_teacher": "ema"})
    config = OmegaConf.create(
        {
            "composer": {"pair_source": "dataset"},
            "actor_rollout_ref": {"actor": ACTOR},
            "data": {"max_response_length": 8},
        }
    )
    with pytest.raises(ValueError, match=r"sdpo_teacher='ema'.*composer\.sdpo_teacher_context"):
        ComposerProducers.from_trainer_config(config, build_tokenizer())
    config.composer = {"sdpo_teacher_context": "success"}
    producers = ComposerProducers.from_trainer_config(config, build_tokenizer())
    assert producers is not None and producers.teacher == "ema"


def test_scored_rows_pad_to_the_actor_micro_batch() -> None:
    """The rows the producers score are padded to dp × rollout.log_prob_micro_batch_size_per_gpu (verl's engine
    asserts the count divides into micro-batches; 3 teacher rows with micro-batch 4 failed before)."""
    from composer_verl.producers import _infer_micro_batch
    from omegaconf import OmegaConf

    rollout = {"log_prob_micro_batch_size_per_gpu": 4, "log_prob_use_dynamic_bsz": False}
    cfg = OmegaConf.create({"actor_rollout_ref": {"rollout": rollout}})
    assert _infer_micro_batch(cfg) == 4
    cfg.actor_rollout_ref.rollout.log_prob_use_dynamic_bsz = True
    assert _infer_micro_batch(cfg) == 1
