"""composer-monarch bound to an environment (composer_core.envs) on a real Monarch proc mesh.

The rewarder actor scores with the environment (loaded in its own process), the teacher reads the
environment's feedback as its hinted context: the embedded digit-reversal env and the verifiers fixture env
(composer-core's tests/fixtures/composer-vf-digits, a verifiers 0.4 taskset) each drive a short run whose three
channels all train.
"""

from __future__ import annotations

import pickle

import pytest
import torch
from composer_core.envs import load_env
from composer_core.tasks import digit_reversal as dr
from composer_monarch import ComposerDriver, ComposerLoss, EnvBoundTask, LoopConfig, ReplayRecord, TinyQwen2

LOSS = ComposerLoss(loss_type="grpo", alpha_sdpo=0.5, beta_replay=0.5, dpo_beta=0.1)
LOOP = LoopConfig(steps=2, prompts_per_step=2, group_size=4, procs=1, overlap=False, call_timeout_s=180)
SPECS = {
    "digit-reversal": {"n_tasks": 8},
    "verifiers:composer_vf_digits": {"taskset_args": {"num_tasks": 8}},
}


def oracle_replay(task: EnvBoundTask, steps: int, n: int) -> list[ReplayRecord]:
    out = []
    for s in range(steps):
        for p in task.prompts(n, step=s):
            answer = dr.oracle_solve(task.codec.text(p))
            out.append(ReplayRecord(p, torch.tensor([*dr.encode(answer), task.eos_id]), 1.0, "oracle"))
    return out


@pytest.mark.parametrize("spec", sorted(SPECS))
def test_env_drives_rewarder_and_teacher_on_the_mesh(spec: str) -> None:
    task = EnvBoundTask(spec, env_kwargs=SPECS[spec])
    pickle.loads(pickle.dumps(task))  # what the actors receive: no live environment inside
    env = load_env(spec, **SPECS[spec])
    texts = {str(t.prompt) for t in env.tasks("train", 8)}
    model = TinyQwen2(task.vocab_size, seed=0)
    with ComposerDriver(task, model, loss=LOSS, loop=LOOP, replay=oracle_replay(task, 4, 2)) as d:
        batch = d.rollout(0)
        # the rewarder's rewards are the environment's own, for every sampled completion
        for prompt, completion, mask, reward in zip(
            batch.prompt_ids, batch.completion_ids, batch.completion_mask, batch.rewards
        ):
            text = task.codec.text(prompt)
            assert text in texts
            (env_task,) = [t for t in env.tasks("train", 8) if t.prompt == text]
            expected = env.reset(env_task).step(task.codec.text(completion[mask.bool()])).reward
            assert float(reward) == pytest.approx(expected, abs=1e-6)
        assert batch.sdpo_rows is not None and bool(batch.sdpo_rows.any())  # the env's feedback is the hint
        results = d.run(steps=2, overlap=False, progress=False)
    for r in results:
        assert (
            r.metrics["composer/sdpo/tokens"] > 0 and r.metrics["composer/sdpo/skipped"] == 0.0
        )  # channel 2 ran
        assert r.extra["pairs"] > 0 and r.metrics["composer/replay/skipped"] == 0.0  # channel 3 ran
    losses = {ch: [r.metrics[f"composer/loss/{ch}"] for r in results] for ch in ("policy", "sdpo", "replay")}
    assert all(any(v != 0.0 for v in vals) for vals in losses.values()), losses


def test_env_bound_task_checks_its_environment() -> None:
    with pytest.raises(ValueError, match="--env"):
        EnvBoundTask("nope:x")
    task = EnvBoundTask("digit-reversal", env_kwargs={"n_tasks": 4})
    prompts = task.prompts(3, step=1)
    assert prompts.shape == (3, 4) and torch.equal(prompts, task.prompts(3, step=1))
    right = torch.tensor(dr.encode(dr.oracle_solve(task.codec.text(prompts[0]))))
    assert task.reward(prompts[0], right) == 1.0
    hinted, has = task.hinted_prompts(
        prompts[:1], right[None], torch.ones(1, right.numel(), dtype=torch.bool)
    )
    assert not bool(has[0]) and hinted.shape == (1, 8)
