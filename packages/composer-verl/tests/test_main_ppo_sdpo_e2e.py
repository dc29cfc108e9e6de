"""verl's real ``main_ppo`` with SDPO as its authors run it: the teacher context built from each ``uid`` group's
successful siblings (``composer.sdpo_teacher_context=success``, no hint function, no environment feedback) and an
EMA teacher held by the actor worker (``sdpo_teacher=ema``), 2 steps on CPU.

Same stand-ins as test_main_ppo_e2e.py (``tests/verl_cpu_testkit``: CPU platform, HF rollout replica, Ray launcher).
The reward is the ``digit-reversal`` environment's partial credit; ``success_reward_threshold=0.1`` makes a
partly right answer a success, so the tiny untrained model has successes to learn from.
"""

from __future__ import annotations

import math

import pytest
from verl_cpu_testkit.launch import RAY_START_FAILED
from verl_cpu_testkit.run import run_main_ppo, step_metrics

pytestmark = pytest.mark.slow  # about 1.5-2 min on 2 free cores; runs in the verl session (no deselection)

COMPOSER = {"alpha_sdpo": 0.5, "sdpo_teacher": "ema", "teacher_update_rate": 0.5}
PRODUCERS = ("+composer.sdpo_teacher_context=success", "+composer.success_reward_threshold=0.1")


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> dict[int, dict[str, float]]:
    tmp = tmp_path_factory.mktemp("main_ppo_sdpo")
    proc = run_main_ppo(tmp, COMPOSER, PRODUCERS, steps=2)
    if proc.returncode == RAY_START_FAILED:  # an overloaded machine, before any verl/composer code ran
        pytest.skip(next(ln for ln in proc.stdout.splitlines() if "RAY_START_FAILED" in ln))
    assert proc.returncode == 0, proc.stdout[-8000:]
    steps = step_metrics(proc.stdout)
    assert sorted(steps) == [1, 2], proc.stdout[-8000:]
    for step, m in sorted(steps.items()):  # shown with -s / in the report
        print(f"step {step}:", {k: m[k] for k in sorted(m) if "composer/" in k or k == "critic/score/mean"})
    return steps


def _get(metrics: dict[str, float], name: str) -> float:
    """A metric by name; verl prefixes the actor's with ``actor/``."""
    hits = [v for k, v in metrics.items() if k == name or k.endswith("/" + name)]
    assert hits, f"metric {name!r} missing; have {sorted(metrics)}"
    return hits[0]


def test_successful_siblings_teach_through_an_ema_teacher(run: dict[int, dict[str, float]]) -> None:
    with_success = [s for s, m in run.items() if _get(m, "composer/sdpo/success_group_fraction") > 0]
    assert with_success, f"no step had a success at threshold 0.1: {run}"
    for step, m in run.items():
        assert math.isfinite(_get(m, "composer/loss/sdpo")), step
        assert _get(m, "composer/sdpo/teacher_synced") == 1.0, step  # the EMA teacher moved after the update
        if step in with_success:
            # failed rows of a group with a success (and successes with a successful sibling) are reprompted
            assert _get(m, "composer/sdpo/reprompt_sample_fraction") > 0, step
            assert _get(m, "composer/sdpo/hinted_rows") > 0 and _get(m, "composer/sdpo/tokens") > 0, step
            assert _get(m, "composer/loss/sdpo") != 0.0, step  # channel 2: the k1 estimate, either sign
        else:  # no success and no feedback source: nothing to distil
            assert _get(m, "composer/sdpo/hinted_rows") == 0.0, step
