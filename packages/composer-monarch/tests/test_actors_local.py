"""The actors' endpoints, spawned in this process (``this_proc().spawn``) — real Monarch, no new process."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from composer_monarch import (
    ComposerDriver,
    ComposerLoss,
    GeneratorActor,
    LoopConfig,
    ReplayRecord,
    ReverseDigits,
    RewarderActor,
    SamplingConfig,
    TeacherActor,
    TinyQwen2,
)
from composer_monarch.model import completion_logits
from composer_monarch.rollout import Rollout, assemble_batch
from monarch.actor import ActorError, this_proc

TASK = ReverseDigits()
MODEL = TinyQwen2(TASK.vocab_size, seed=0)


def _sampling(seed: int) -> SamplingConfig:
    return SamplingConfig(
        max_new_tokens=TASK.max_new_tokens, eos_id=TASK.eos_id, pad_id=TASK.pad_id, seed=seed
    )


def test_generator_seed_and_weights_decide_the_samples() -> None:
    prompts = TASK.prompts(3, step=0)
    g0 = this_proc().spawn("gen_a", GeneratorActor, MODEL, _sampling(0))
    g0b = this_proc().spawn("gen_b", GeneratorActor, MODEL, _sampling(0))
    g1 = this_proc().spawn("gen_c", GeneratorActor, MODEL, _sampling(1))
    a = g0.generate.call_one(5, prompts, 4).get(timeout=120)
    b = g0b.generate.call_one(5, prompts, 4).get(timeout=120)
    c = g1.generate.call_one(5, prompts, 4).get(timeout=120)
    assert isinstance(a, Rollout) and a.group_size == 4 and a.prompt_ids.shape == (12, prompts.shape[1])
    assert torch.equal(a.prompt_ids[:4], prompts[:1].expand(4, -1))  # groups are contiguous
    assert torch.equal(a.completion_ids, b.completion_ids)  # same seed, same step → same samples
    assert not torch.equal(a.completion_ids, c.completion_ids)  # the seed matters
    # new weights change the samples' log-probs and the version stamp
    other = TinyQwen2(TASK.vocab_size, seed=1)().state_dict()
    assert g0b.update_weights.call_one(7, other).get(timeout=60) == 7
    d = g0b.generate.call_one(5, prompts, 4).get(timeout=120)
    assert d.policy_version == 7 and not torch.equal(d.inference_logprobs, b.inference_logprobs)
    with pytest.raises(ActorError, match="weights do not fit"):
        g0b.update_weights.call_one(8, {"nope": torch.zeros(1)}).get(timeout=60)


def test_teacher_hinted_logits_and_pairs() -> None:
    prompts = TASK.prompts(2, step=3)
    records = [ReplayRecord(p, TASK.target(p), 1.0, "oracle") for p in prompts]
    teacher = this_proc().spawn("teacher_t", TeacherActor, MODEL, records, TASK.pad_id)
    completions = torch.tensor([[5, 6, 7, 1], [8, 9, 1, 0]])
    hinted, has_hint = TASK.hinted_prompts(prompts, completions, completions != 0)
    assert has_hint.all()
    shape = teacher.hinted_logits.call_one(hinted, completions, "k").get(timeout=120)
    got = teacher.take_logits.call_one("k").get(timeout=60)
    assert shape == tuple(got.shape)
    with torch.no_grad():
        expected = completion_logits(MODEL(), hinted, completions)
    assert torch.equal(got, expected)
    # the hint changes the teacher's view of the same completion
    with torch.no_grad():
        plain = completion_logits(MODEL(), prompts, completions)
    assert not torch.allclose(got, plain)
    ro = Rollout(3, prompts, completions, completions != 0, torch.zeros(2, 4), 0, 1)
    pairs = teacher.preference_pairs.call_one(ro, torch.tensor([0.25, 1.0])).get(timeout=60)
    assert len(pairs) == 1 and torch.equal(pairs.chosen_ids[0], TASK.target(prompts[0]))
    with pytest.raises(ActorError, match="one hinted prompt per completion"):
        teacher.hinted_logits.call_one(hinted[:1], completions, "k").get(timeout=60)


def _zero(prompt: torch.Tensor, completion: torch.Tensor) -> float:
    return 0.0


def test_rewarder_weights_and_errors() -> None:
    rewarder = this_proc().spawn("rewarder_t", RewarderActor, [TASK.reward, _zero], [2.0, 1.0])
    prompts = TASK.prompts(1, step=0)
    target = TASK.target(prompts[0]).unsqueeze(0)
    ro = Rollout(0, prompts, target, torch.ones_like(target, dtype=torch.bool), torch.zeros(1, 4), 0, 1)
    assert rewarder.score.call_one(ro).get(timeout=60).tolist() == [2.0]


def test_assemble_batch_advantage_scales() -> None:
    prompts = TASK.prompts(2, step=0).repeat_interleave(2, dim=0)
    ro = Rollout(
        0,
        prompts,
        torch.ones(4, 2, dtype=torch.long),
        torch.ones(4, 2, dtype=torch.bool),
        torch.zeros(4, 2),
        0,
        2,
    )
    rewards = torch.tensor([1.0, 0.0, 0.5, 0.5])
    group = assemble_batch(ro, rewards, advantage_scale="group")
    # (r − mean) / (std + 1e-4), std unbiased: group 1 std = √0.5; group 2 has zero std → 0
    s = 0.5**0.5
    torch.testing.assert_close(
        group.advantages, torch.tensor([0.5 / (s + 1e-4), -0.5 / (s + 1e-4), 0.0, 0.0])
    )
    none = assemble_batch(ro, rewards, advantage_scale="none")
    assert none.advantages.tolist() == [0.5, -0.5, 0.0, 0.0]
    with pytest.raises(ValueError, match="one reward per completion"):
        assemble_batch(ro, rewards[:3])


def test_loop_config_and_driver_arguments_are_checked() -> None:
    with pytest.raises(ValueError, match="advantage_scale"):
        LoopConfig(advantage_scale="std")
    with pytest.raises(ValueError, match="unknown role"):
        LoopConfig(placement={"critic": 0})
    with pytest.raises(ValueError, match="call_timeout_s"):
        LoopConfig(call_timeout_s=0)
    with pytest.raises(ValueError, match="group_size"):
        LoopConfig(group_size=0)
    with pytest.raises(ValueError, match="no replay records"):
        ComposerDriver(TASK, MODEL, loss=ComposerLoss(beta_replay=0.5))
    with pytest.raises(RuntimeError, match="not started"):
        ComposerDriver(TASK, MODEL, loss=ComposerLoss(beta_replay=0.0)).weights()


def test_placement_defaults_and_overrides() -> None:
    loop = LoopConfig(procs=3, placement={"teacher": 1, "rewarder": (0, 0)})
    assert loop.slot("trainer") == (0, 0)  # the trainer has proc 0 to itself by default
    assert loop.slot("generator") == (0, 2)  # the rest share the last proc
    assert loop.slot("teacher") == (0, 1)
    assert loop.slot("rewarder") == (0, 0)


def test_fault_router_routes_by_mesh_name() -> None:
    """Routing only (Monarch's MeshFailure cannot be built by hand; a namespace carries mesh_name)."""
    from types import SimpleNamespace

    import monarch.actor as monarch_actor
    from composer_monarch.errors import _FaultRouter

    saved = monarch_actor.unhandled_fault_hook
    foreign: list[object] = []
    try:
        monarch_actor.unhandled_fault_hook = foreign.append
        router = _FaultRouter()
        got: list[tuple[str, object]] = []
        router.register("composer_abcd1234_", lambda role, f: got.append((role, f)))
        assert monarch_actor.unhandled_fault_hook is router
        mine = SimpleNamespace(mesh_name="composer_abcd1234_rewarder-XyZ")
        stale = SimpleNamespace(mesh_name="composer_00000000_trainer-AbC")
        internal = SimpleNamespace(mesh_name="logger-QwE")
        users = SimpleNamespace(mesh_name="my_workers-RtY")
        for f in (mine, stale, internal, users):
            router(f)
        assert got == [("rewarder", mine)]  # this driver's actor, by role
        assert foreign == [users]  # not composer's: the previous hook decides
        router.unregister("composer_abcd1234_")
        router(mine)  # a late report after the driver stopped is dropped
        assert len(got) == 1 and foreign == [users]
    finally:
        monarch_actor.unhandled_fault_hook = saved


class _HintRows(ReverseDigits):
    """ReverseDigits whose hint rule gives a hint to the completions of ``rows`` only."""

    def __init__(self, rows: tuple[int, ...]) -> None:
        super().__init__()
        object.__setattr__(self, "rows", rows)

    def hinted_prompts(
        self, prompts: torch.Tensor, completions: torch.Tensor, completion_mask: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        hinted, _ = super().hinted_prompts(prompts, completions, completion_mask)
        has_hint = torch.zeros(prompts.shape[0], dtype=torch.bool)
        has_hint[list(self.rows)] = True
        return hinted, has_hint


@pytest.mark.parametrize("rows", [(), (0, 3)])
def test_rollout_distils_only_hinted_completions(rows: tuple[int, ...]) -> None:
    """A correct completion has no hint (composer-core's rule): it is not distilled, and a step where
    no completion has a hint sends no teacher call and no channel-2 inputs."""
    task = _HintRows(rows)
    d = ComposerDriver(task, MODEL, loss=ComposerLoss(alpha_sdpo=0.5, beta_replay=0.0), loop=LoopConfig())
    tag = "".join(map(str, rows)) or "none"
    d.actors = {
        "generator": this_proc().spawn(f"gen_h{tag}", GeneratorActor, MODEL, _sampling(0)),
        "rewarder": this_proc().spawn(f"rew_h{tag}", RewarderActor, [task.reward]),
        "teacher": this_proc().spawn(f"tea_h{tag}", TeacherActor, MODEL, None, task.pad_id),
    }
    batch = d.rollout(0)
    assert batch.completion_ids.shape[0] == 8
    if not rows:
        assert batch.teacher_logits is None and batch.sdpo_rows is None and batch.teacher_key is None
    else:
        assert (
            batch.teacher_logits is None and batch.teacher_key is not None
        )  # the logits stay on the teacher
        batch = replace(batch, teacher_logits=d._call("teacher", "take_logits", batch.teacher_key)())
        assert (
            batch.teacher_logits is not None and batch.teacher_logits.shape[:2] == batch.completion_ids.shape
        )
        assert batch.sdpo_rows is not None and batch.sdpo_rows.nonzero().flatten().tolist() == list(rows)
    d.actors = {}


# ---------------------------------------------------------------- SDPO as its authors run it (issue 48)


def test_teacher_context_conformance_through_the_driver_path() -> None:
    from composer_monarch.contexts import text_teacher_contexts
    from composer_testkit.teacher_context import check_teacher_context

    assert len(check_teacher_context(text_teacher_contexts)) >= 3


def test_driver_success_context_with_an_ema_teacher() -> None:
    """sdpo_teacher_context='success' + sdpo_teacher='ema': failed rows are distilled toward a successful
    sibling's answer (sdpo > 0 on a step with a success), and after 2 steps the teacher's weights are
    (1-r)^2 θ0 + r(1-r) θ1 + r θ2 of the trainer's weights θ0 (initial), θ1, θ2 (after steps 1, 2)."""
    from composer_core.sdpo.context import TeacherContextOptions
    from composer_core.sdpo.teacher import TeacherWeightsOptions

    task = ReverseDigits(n_digits=2, length=2)
    model = TinyQwen2(task.vocab_size, seed=0)
    ctx = TeacherContextOptions(
        sdpo_teacher_context="success",
        success_reward_threshold=0.3,  # partial credit: the untrained model gets 1/3 on some rows
        reprompt_template="{solution}{prompt}",
        solution_template="{demonstration}|",
    )
    rate = 0.25
    loss = ComposerLoss(alpha_sdpo=1.0, beta_replay=0.0)
    loop = LoopConfig(steps=1, prompts_per_step=4, group_size=4, procs=1, num_threads=1)
    with ComposerDriver(
        task,
        model,
        loss=loss,
        loop=loop,
        teacher_context=ctx,
        teacher_weights=TeacherWeightsOptions(sdpo_teacher="ema", teacher_update_rate=rate),
    ) as d:
        theta = [d.weights()]
        kind, teacher0 = d._call("teacher", "teacher_weights")()
        assert kind == "ema" and all(torch.equal(teacher0[k], v) for k, v in theta[0].items())
        results = []
        for _ in range(2):
            results += d.run(steps=1, progress=False)
            theta.append(d.weights())
        _, teacher = d._call("teacher", "teacher_weights")()
    distilled = [r for r in results if r.metrics.get("composer/sdpo/tokens", 0) > 0]
    assert distilled, [r.metrics for r in results]  # a step with a success distils its failed siblings
    assert all(r.metrics["composer/loss/sdpo"] > 0 for r in distilled)
    for k, t in teacher.items():
        want = (1 - rate) ** 2 * theta[0][k] + rate * (1 - rate) * theta[1][k] + rate * theta[2][k]
        torch.testing.assert_close(t, want, rtol=1e-5, atol=1e-6)
    assert not torch.equal(teacher[next(iter(teacher))], theta[2][next(iter(teacher))])  # not the live policy


def test_rollout_contexts_use_siblings_of_the_same_group_only() -> None:
    from composer_core.sdpo.context import TeacherContextOptions
    from composer_monarch.contexts import rollout_teacher_contexts

    task = ReverseDigits(length=2)
    a, b = torch.tensor([3, 4, 13]), torch.tensor([5, 6, 13])  # "01>", "23>"
    prompts = torch.stack([a, a, b, b])
    right_a, wrong = [4, 3, 1], [7, 7, 1]  # "10", "44"
    completions = torch.tensor([wrong, right_a, wrong, wrong])
    ro = Rollout(
        step=0,
        prompt_ids=prompts,
        completion_ids=completions,
        completion_mask=completions != 0,
        inference_logprobs=torch.zeros(4, 3),
        group_size=2,
        policy_version=0,
    )
    rewards = torch.tensor([task.reward(pr, c[c != 0]) for pr, c in zip(prompts, completions)])
    opts = TeacherContextOptions(
        sdpo_teacher_context="success",
        reprompt_template="{solution}{prompt}",
        solution_template="{demonstration}|",
    )
    ids, rows = rollout_teacher_contexts(task, ro, rewards, opts)
    assert rows.tolist() == [True, False, False, False]  # the success isn't reprompted; group b has none
    assert task.text(ids[0]) == "10|01>"
    with pytest.raises(
        ValueError, match="reprompt_template"
    ):  # the default template is not in the vocabulary
        rollout_teacher_contexts(task, ro, rewards, TeacherContextOptions(sdpo_teacher_context="success"))
    with pytest.raises(ValueError, match="feedback"):
        rollout_teacher_contexts(task, ro, rewards, TeacherContextOptions(sdpo_teacher_context="feedback"))
    with pytest.raises(ValueError, match="alpha_sdpo is 0"):  # no silent no-op option
        ComposerDriver(task, MODEL, loss=ComposerLoss(alpha_sdpo=0.0, beta_replay=0.0), teacher_context=opts)


def test_max_reprompt_len_caps_the_teacher_prompt() -> None:
    """max_reprompt_len=5 keeps each teacher prompt's last 5 tokens (issue 60: 9–15 token prompts here while TRL
    and verl cut to 5), on the group path (rollout_teacher_contexts) and on the hint path (through the driver)."""
    from composer_core.sdpo.context import TeacherContextOptions
    from composer_monarch.contexts import rollout_teacher_contexts

    task = ReverseDigits(length=2)
    a = torch.tensor([3, 4, 13])  # "01>"
    completions = torch.tensor([[7, 7, 1], [4, 3, 1]])  # "44" (wrong), "10" (right)
    ro = Rollout(
        step=0, prompt_ids=torch.stack([a, a]), completion_ids=completions, completion_mask=completions != 0,
        inference_logprobs=torch.zeros(2, 3), group_size=2, policy_version=0,
    )  # fmt: skip
    rewards = torch.tensor([task.reward(a, c[c != 0]) for c in completions])
    opts = TeacherContextOptions(
        sdpo_teacher_context="success", reprompt_template="{solution}{prompt}", solution_template="{demonstration}||",
        max_reprompt_len=5,
    )  # fmt: skip
    ids, rows = rollout_teacher_contexts(task, ro, rewards, opts)
    assert rows.tolist() == [True, False] and task.text(ids[0]) == "0||01>"[-5:]  # "10||01>" uncapped
    seen: list[torch.Tensor] = []
    loop = LoopConfig(steps=1, prompts_per_step=2, group_size=2, procs=1, num_threads=1)
    loss = ComposerLoss(alpha_sdpo=1.0, beta_replay=0.0)
    with ComposerDriver(
        TASK, MODEL, loss=loss, loop=loop, teacher_context=TeacherContextOptions(max_reprompt_len=5)
    ) as d:
        real = d._call

        def spy(role: str, endpoint: str, *args: object, **kw: object) -> object:
            if endpoint == "hinted_logits":
                seen.append(args[0])  # type: ignore[arg-type]
            return real(role, endpoint, *args, **kw)

        d._call = spy  # type: ignore[method-assign]
        d.run(steps=1, progress=False)
    assert seen and all(ctx.shape[1] == 5 for ctx in seen)
