"""The SDPO teacher's context built from the group (core's one implementation)."""

from __future__ import annotations

import pytest
from composer_core.sdpo import TeacherContextOptions, build_teacher_contexts, cap_reprompt, remove_thinking
from composer_core.testing.conformance import ConformanceError
from composer_testkit.teacher_context import check_teacher_context


def _opts(source: str = "success", **kw: object) -> TeacherContextOptions:
    templates = {
        "reprompt_template": "{prompt}|{solution}|{feedback}",
        "solution_template": "<{demonstration}>",
        "feedback_template": "[{feedback}]",
    }
    return TeacherContextOptions(sdpo_teacher_context=source, **{**templates, **kw})  # type: ignore[arg-type]


def _core(prompts, completions, rewards, group_size, feedback, options):  # type: ignore[no-untyped-def]
    ctx = build_teacher_contexts(prompts, completions, rewards, group_size, options, feedback=feedback)
    return ctx.contexts, ctx.mask


def test_core_passes_its_own_conformance_case_and_a_wrong_builder_fails_it() -> None:
    assert len(check_teacher_context(_core)) == 5

    def self_teaching(prompts, completions, rewards, group_size, feedback, options):  # type: ignore[no-untyped-def]
        opts = TeacherContextOptions(**{**options.__dict__, "dont_reprompt_on_self_success": False})
        return _core(prompts, completions, rewards, group_size, feedback, opts)

    with pytest.raises(ConformanceError, match="mask"):
        check_teacher_context(self_teaching)


def test_random_pick_is_seeded_per_group_and_never_the_row_itself() -> None:
    prompts, comps = ["p"] * 4 + ["q"] * 4, list("abcdefgh")
    rewards = [1.0, 1.0, 1.0, 0.0, 1.0, 1.0, 0.0, 1.0]
    opts = _opts(demo_pick="random")
    a = build_teacher_contexts(prompts, comps, rewards, 4, opts, seed=7)
    assert a.demo_index == build_teacher_contexts(prompts, comps, rewards, 4, opts, seed=7).demo_index
    for i, j in enumerate(a.demo_index):
        assert j is not None and j != i and j // 4 == i // 4 and rewards[j] == 1.0
    seeds = {
        tuple(build_teacher_contexts(prompts, comps, rewards, 4, opts, seed=s).demo_index) for s in range(20)
    }
    assert len(seeds) > 1  # the seed matters
    first = build_teacher_contexts(prompts, comps, rewards, 4, _opts(), seed=7)
    assert first.demo_index == [1, 0, 0, 0, 5, 4, 4, 4]


def test_feedback_only_without_solution_and_metrics() -> None:
    opts = _opts("success+feedback", feedback_only_without_solution=True)
    ctx = build_teacher_contexts(["p", "p", "q", "q"], ["a", "b", "c", "d"], [1, 0, 0, 0], 2, opts,
                                 feedback=[None, "fb1", "fb2", ""])  # fmt: skip
    assert ctx.contexts == [None, "p|<a>|", "q||[fb2]", None]
    assert ctx.mask == [False, True, True, False]
    assert ctx.metrics == {
        "success_group_fraction": 0.5,
        "success_sample_fraction": 0.25,
        "feedback_used_fraction": 0.25,
        "reprompt_sample_fraction": 0.5,
    }


def test_helpers() -> None:
    assert remove_thinking("<think>a\nb</think> 42 <think>x</think>") == "42"
    assert cap_reprompt([1, 2, 3, 4], 2) == [3, 4] and cap_reprompt([1, 2], None) == [1, 2]


@pytest.mark.parametrize(
    ("build", "match"),
    [
        (lambda: _opts(reprompt_template="{prompt}{answer}"), r"unknown placeholder.*\{answer\}"),
        (lambda: _opts(solution_template="{demonstration"), "not a valid format string"),
        (lambda: _opts(feedback_template="{feedback.x}"), "unknown placeholder"),
        (lambda: TeacherContextOptions(solution_template="{demonstration}!"), "only act"),
        (lambda: TeacherContextOptions(sdpo_teacher_context="oracle"), "not supported"),  # type: ignore[arg-type]
        (lambda: _opts(max_reprompt_len=0), "max_reprompt_len"),
        (lambda: _opts(feedback_only_without_solution=True), r"success\+feedback"),
        (lambda: _opts(success_reward_threshold=float("nan")), "success_reward_threshold"),
    ],
)
def test_bad_options_raise_naming_the_option(build, match) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ValueError, match=match):
        build()


def test_bad_inputs_raise() -> None:
    opts = _opts()
    with pytest.raises(ValueError, match="group_size"):
        build_teacher_contexts(["p"] * 3, ["a"] * 3, [1.0] * 3, 2, opts)
    with pytest.raises(ValueError, match="one per row"):
        build_teacher_contexts(["p"] * 2, ["a"], [1.0] * 2, 2, opts)
    with pytest.raises(ValueError, match="needs the environment's feedback"):
        build_teacher_contexts(["p"] * 2, ["a"] * 2, [1.0, 0.0], 2, _opts("feedback"))
    with pytest.raises(ValueError, match=r"last message.*user turn"):
        chat = [{"role": "user", "content": "u"}, {"role": "assistant", "content": "pre"}]
        build_teacher_contexts([chat, chat], ["a", "b"], [1.0, 0.0], 2, opts)
    with pytest.raises(ValueError, match="uses hints"):
        build_teacher_contexts(["p"], ["a"], [1.0], 1, TeacherContextOptions())
