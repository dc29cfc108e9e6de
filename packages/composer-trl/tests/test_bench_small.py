"""The bench script runs (CI's check at ``--small``; times are not asserted, benchmarks are scripts): every
trainer, the extra forwards and the reward comparison, and both sides of that comparison start from the same
rewards (same seed, same model, same first rollout)."""

from __future__ import annotations

from pathlib import Path

import pytest
from composer_core.testing.bench import load_bench_json, run_small_bench

BENCH = Path(__file__).resolve().parents[1] / "bench" / "bench_trl.py"


def test_bench_runs_at_small_size(tmp_path: Path) -> None:
    run_small_bench(BENCH, tmp_path)
    data = load_bench_json(tmp_path / "bench_trl.json")
    assert len(data["readme"]["rows"]) == 4
    assert data["small"] is True
    assert {k: len(v["runs"]) for k, v in data["step_seconds"].items()} == {
        "grpo": data["repeats"],
        "composer-off": data["repeats"],
        "composer-on": data["repeats"],
    }
    assert set(data["extras_alone_seconds"]) == {"teacher_forward", "pair_forward_backward"}
    reward = data["reward"]
    assert reward["composer"]["reward_first"] == pytest.approx(reward["grpo"]["reward_first"])
