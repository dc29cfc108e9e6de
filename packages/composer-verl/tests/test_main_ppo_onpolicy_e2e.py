"""verl's real ``main_ppo`` with channel 3 on the student's own failures (``composer.replay_pairs=on_policy``).

The same stand-ins as test_main_ppo_e2e.py (CPU platform, HF-``generate`` rollout). The data carries the
environment's reference answer as ``chosen`` and no ``rejected`` column; each step, every response whose reward is
below ``success_reward_threshold`` (1.0: not fully reversed) is appended as the rejected side of one pair with its
row's ``chosen``. Channel 1 + channel 3 only (SimPO with RPO's NLL)."""

from __future__ import annotations

import math

import pytest
from verl_cpu_testkit.launch import RAY_START_FAILED
from verl_cpu_testkit.run import run_main_ppo, step_metrics

pytestmark = pytest.mark.slow

COMPOSER = {"beta_replay": 0.25, "dpo_variant": "simpo", "rpo_alpha": 0.1}
PRODUCERS = ("+composer.pair_source=dataset", "+composer.replay_pairs=on_policy")


def _get(metrics: dict[str, float], name: str) -> float:
    hits = [v for k, v in metrics.items() if k == name or k.endswith("/" + name)]
    assert hits, f"metric {name!r} missing; have {sorted(metrics)}"
    return hits[0]


def test_on_policy_pairs_in_verls_loop(tmp_path: pytest.TempPathFactory) -> None:
    proc = run_main_ppo(tmp_path, COMPOSER, PRODUCERS, steps=2, pair_columns=("chosen",))  # type: ignore[arg-type]
    if proc.returncode == RAY_START_FAILED:
        pytest.skip(next(ln for ln in proc.stdout.splitlines() if "RAY_START_FAILED" in ln))
    assert proc.returncode == 0, proc.stdout[-8000:]
    steps = step_metrics(proc.stdout)
    assert sorted(steps) == [1, 2], proc.stdout[-8000:]
    for step, m in steps.items():
        appended = _get(m, "composer/replay/appended_pairs")
        # 2 prompts x 4 responses, a random tiny model: failures, each its own pair (at most 8)
        assert 0 < appended <= 8, (step, appended)
        assert math.isfinite(_get(m, "composer/loss/replay")) and _get(m, "composer/loss/replay") > 0, step
        assert _get(m, "composer/replay/pairs") > 0, step
