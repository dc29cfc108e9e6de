"""verl's real ``main_ppo`` for 3 steps on CPU with composer's plugin and all three channels produced in its loop.

What is verl's: ``verl.trainer.main_ppo.main`` (Hydra config = the shipped ``composer_grpo_producers``-style
selections on verl's ``ppo_trainer``), the v1 trainer (``trainer_mode=composer_sync`` = ``PPOTrainerSync`` +
composer's actor worker), Ray, TransferQueue, the FSDP2 actor, the agent loop, the reward loop calling the
task's reward function, ``grpo_composer`` advantages, the ``composer`` policy loss, weight sync each step.
What is composer's: the environment ``digit-reversal`` (``composer_core.envs``) as task, reward and hint source
(``composer_verl.envs``: the data, verl's custom reward function, ``composer.env``), the producers
(``composer_verl.producers``): hints = the environment's feedback, channel 2 in its top-k form (the actor's
module re-reads each response on the hinted prompt inside its training forward, ``sdpo_form=topk``),
pairs from the dataset's ``chosen``/``rejected`` columns (the environment's reference answer / typical mistake).

What is a TEST STAND-IN (``tests/verl_cpu_testkit``, never shipped): the CPU platform, the HF-``generate``
rollout replica (vLLM/SGLang have no CPU path here), Ray started by the launcher with bounded retries and
gloo initialised before verl's own process-group init (see the kit's docstrings).
"""

from __future__ import annotations

import math

import pytest
from verl_cpu_testkit.launch import RAY_START_FAILED
from verl_cpu_testkit.run import run_main_ppo, step_metrics

pytestmark = pytest.mark.slow  # about 2-3 min on 2 free cores; runs in the verl session (no deselection)

# channel 2 in its top-k form (sdpo_form=topk: the live teacher's top-k inside the actor's training forward); the
# sampled-token form runs end to end in test_main_ppo_sdpo_e2e.py
COMPOSER = {
    "alpha_sdpo": 0.5,
    "beta_replay": 0.25,
    "dpo_variant": "simpo",
    "sdpo_form": "topk",
    "sdpo_topk": 8,
}
PRODUCERS = ("+composer.env=digit-reversal", "+composer.pair_source=dataset")


def loss_key(channel: str) -> str:
    """composer's per-channel loss metric as verl logs it (``policy``, ``sdpo``, ``replay``)."""
    return f"composer/loss/{channel}"


def _get(metrics: dict[str, float], name: str) -> float:
    hits = [v for k, v in metrics.items() if k == name or k.endswith("/" + name)]
    assert hits, f"metric {name!r} missing; have {sorted(metrics)}"
    return hits[0]


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> dict[int, dict[str, float]]:
    tmp = tmp_path_factory.mktemp("main_ppo")
    proc = run_main_ppo(tmp, COMPOSER, PRODUCERS)
    if proc.returncode == RAY_START_FAILED:  # an overloaded machine, before any verl/composer code ran
        pytest.skip(next(ln for ln in proc.stdout.splitlines() if "RAY_START_FAILED" in ln))
    assert proc.returncode == 0, proc.stdout[-8000:]
    steps = step_metrics(proc.stdout)
    assert sorted(steps) == [1, 2, 3], proc.stdout[-8000:]
    for step, m in sorted(steps.items()):  # shown with -s / in the report
        print(
            f"step {step}:",
            {
                k: m[k]
                for k in sorted(m)
                if k.startswith(("composer/", "actor/pg_loss", "critic/score/mean", "training/rollout"))
            },
        )
    return steps


def test_three_steps_with_all_three_channels_non_zero(run: dict[int, dict[str, float]]) -> None:
    for step, m in run.items():
        for name in ("pg_loss", *map(loss_key, ("policy", "sdpo", "replay"))):
            assert math.isfinite(_get(m, name)), (step, name)
        assert _get(m, "composer/sdpo/hinted_rows") > 0, (
            step
        )  # the environment gave feedback on wrong answers
        assert _get(m, "composer/sdpo/tokens") > 0, step
        assert _get(m, "composer/replay/appended_pairs") == 2.0, step  # one pair per prompt group, 2 prompts
        assert _get(m, "composer/replay/pairs") > 0, step
        # channel 2 (top-k generalized JSD with the tail bucket) and SimPO's loss are > 0
        assert _get(m, loss_key("sdpo")) > 0.0 and _get(m, loss_key("replay")) > 0.0, step
        assert 0.0 <= _get(m, "critic/score/mean") <= 1.0, step  # the environment's partial-credit reward


def test_rollout_and_actor_log_probs_agree(run: dict[int, dict[str, float]]) -> None:
    """The stand-in rollout samples from softmax(logits/T) of the weights verl synced to it: verl's own
    rollout-vs-actor diagnostics must show the same policy (pair rows carry the actor's own log-probs)."""
    for step, m in run.items():
        assert _get(m, "training/rollout_probs_diff_max") < 1e-3, step
        assert _get(m, "training/rollout_actor_probs_pearson_corr") > 0.999, step
